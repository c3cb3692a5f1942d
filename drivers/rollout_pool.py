"""The rollout workers as the driver sees them: weight broadcasts and generation that survives faults.

Work is a set of numbered chunks of prompts. Each worker runs one chunk at a time, so a slow worker
takes fewer chunks and a deadline applies to one call. When a call fails:

- the worker died (killed, OOM, node lost): Ray restarts it (``rollout.max_restarts``); the pool
  waits for it, loads the newest broadcast weights into it (a restarted engine starts from the base
  model) and gives the chunk out again;
- the call ran past ``rollout.generate_timeout_s`` (a hung engine or reward): the worker is killed
  and restarted the same way;
- the call raised: the chunk is retried, at most ``rollout.chunk_retries`` times.

Every chunk's result is accepted exactly once (``on_result``), so a stage has each group once. A weight
broadcast survives a dead worker the same way (restarted and given the weights, or left out). When no
worker is left, or a chunk keeps failing, :class:`~drivers.stops.RolloutFailed` stops the run with the
way to resume it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from drivers.stops import RolloutFailed, brief
from mugrpo_async.config import Config

log = logging.getLogger(__name__)

__all__ = ["RolloutFailed", "RolloutPool"]


class RolloutPool:
    """Rollout worker handles plus the newest broadcast weights (re-applied to restarted workers)."""

    def __init__(self, cfg: Config, workers: list):
        self.cfg, self.workers = cfg, list(workers)
        self.weights: tuple[int, object] | None = None  # (policy version, PackedWeights ref)
        self.restarts = 0

    def broadcast(self, packed_ref, version: int) -> float:
        """Every worker loads the same weights ref in place; returns the seconds it took.

        A worker that dies meanwhile is restarted and given the weights (:meth:`heal`) or left out.
        """
        t0 = time.perf_counter()
        self.weights = (version, packed_ref)
        loading = {w.update_weights.remote(packed_ref): w for w in self.workers}
        for ref, worker in loading.items():
            try:
                ray.get(ref)
            except RayActorError as err:
                log.warning("a rollout worker died while loading weights (%s)", type(err).__name__)
                self.heal(worker)
        if not self.workers:
            raise RolloutFailed("no rollout worker is left alive (rollout.max_restarts="
                                f"{self.cfg.rollout.max_restarts})")  # fmt: skip
        return time.perf_counter() - t0

    def heal(self, worker) -> bool:
        """Wait for Ray to restart ``worker`` and give it the newest weights; False if it is gone for good."""
        deadline = time.monotonic() + self.cfg.rollout.generate_timeout_s
        try:
            while True:
                try:
                    info = ray.get(worker.info.remote(), timeout=max(1.0, deadline - time.monotonic()))
                    break
                except ActorUnavailableError:  # still restarting
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            if self.weights is not None and info["policy_version"] != self.weights[0]:
                ray.get(worker.update_weights.remote(self.weights[1]), timeout=self.cfg.rollout.generate_timeout_s)
        except (RayActorError, GetTimeoutError) as err:
            log.error("rollout worker could not be restarted (%s)", type(err).__name__)
            self.workers.remove(worker)
            return False
        self.restarts += 1
        log.warning("rollout worker %d restarted and holds policy version %d", info["index"],
                    self.weights[0] if self.weights else 0)  # fmt: skip
        return True

    def generate(self, chunks: dict[int, list[dict]], on_result: Callable[[int, dict], None]) -> dict:
        """Generate every chunk; ``on_result(chunk, output)`` is called once per chunk as it finishes.

        Returns:
            Fault counters: ``worker_failures``, ``timeouts``, ``retries``.
        """
        r = self.cfg.rollout
        todo, free = deque(sorted(chunks)), deque(self.workers)
        pending: dict = {}  # ref -> (chunk, worker, deadline)
        attempts = dict.fromkeys(chunks, 0)
        faults = {"worker_failures": 0, "timeouts": 0, "retries": 0}
        while todo or pending:
            while todo and free:
                c, w = todo.popleft(), free.popleft()
                pending[w.generate.remote(chunks[c])] = (c, w, time.monotonic() + r.generate_timeout_s)
            if not pending:
                raise RolloutFailed("no rollout worker is left alive (rollout.max_restarts="
                                    f"{r.max_restarts}); resume the run once the cluster is healthy")  # fmt: skip
            first = min(d for _, _, d in pending.values())  # inf: every call left is a killed one
            wait_s = None if first == float("inf") else max(0.0, first - time.monotonic())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            if not done:  # a call ran past its deadline: kill the worker, the failure path below restarts it
                for ref, (c, w, deadline) in list(pending.items()):
                    if time.monotonic() >= deadline:
                        log.error("chunk %d: no answer within rollout.generate_timeout_s=%gs; restarting its worker",
                                  c, r.generate_timeout_s)  # fmt: skip
                        faults["timeouts"] += 1
                        ray.kill(w, no_restart=False)
                        pending[ref] = (c, w, float("inf"))
                continue
            c, w, _ = pending.pop(done[0])
            try:
                out = ray.get(done[0])
            except RayTaskError as err:  # the call raised (first: a task error may wrap another actor's death)
                attempts[c] += 1
                if attempts[c] > r.chunk_retries:
                    raise RolloutFailed(f"chunk {c} failed {attempts[c]} times; last error: {brief(err)}") from None
                faults["retries"] += 1
                log.warning("chunk %d failed (%s); retry %d of %d", c, brief(err), attempts[c], r.chunk_retries)
                todo.appendleft(c)
                free.append(w)
                continue
            except RayActorError as err:  # the worker itself died
                faults["worker_failures"] += 1
                log.warning("chunk %d: rollout worker died (%s); generating the chunk again", c, type(err).__name__)
                todo.appendleft(c)
                if self.heal(w):
                    free.append(w)
                continue
            on_result(c, out)
            free.append(w)
        return faults
