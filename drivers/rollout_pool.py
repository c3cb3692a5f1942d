"""The rollout workers as the driver sees them: weight broadcasts, and generation that survives faults.

Work is a set of numbered items: the chunks of a sync stage's prompts (:meth:`RolloutPool.generate`) or the
shares of an evaluation (:meth:`RolloutPool.evaluate`). Each worker runs one item at a time, so a slow
worker takes fewer. Every call is a streaming call (:class:`Watched`): the worker yields progress reports
while its engine generates, then the result. When a call fails:

- the worker died (killed, OOM, node lost): Ray restarts it (``rollout.max_restarts``); the pool
  waits for it (``rollout.restart_timeout_s``), loads the newest broadcast weights into it (a restarted
  engine starts from the base model) and gives the item out again;
- the call stalled, no token generated and no group finished for ``rollout.stall_timeout_s`` (a hung
  engine, :mod:`mugrpo_async.rollout.progress`): the worker is killed and restarted the same way. A long
  call that keeps generating is never cut, however long it runs;
- the call raised: the item is retried, at most ``rollout.chunk_retries`` times.

Every item's result is accepted exactly once (``on_result``), so a stage has each group once and an
evaluation each problem once. A weight broadcast survives a dead worker the same way (restarted and given
the weights, or left out). When no worker is left, or an item keeps failing, :class:`~drivers.stops.RolloutFailed`
stops the run with the way to resume it. The async driver watches its workers' generation loops with the
same :class:`Watched` rule.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from drivers.stops import RolloutFailed, brief
from mugrpo_async.config import Config
from mugrpo_async.rollout.progress import StallWatch

log = logging.getLogger(__name__)

__all__ = ["RolloutFailed", "RolloutPool", "Watched"]


@dataclass
class _Call:
    tag: object  # what the caller knows the call by (a chunk number, a worker index)
    worker: object
    label: str  # for the log: "chunk 3", "rollout worker 1"


class Watched:
    """Streaming calls on rollout workers (progress reports, then ``{"result": ...}``) under the stall rule.

    A call whose worker reports busy and whose counters do not move for ``stall_timeout_s`` is ended by
    killing its worker (:meth:`kill_stalled`); Ray restarts the worker, and the call then ends with the
    worker's death (``RayActorError``), which the caller handles as any other death.
    """

    def __init__(self, stall_timeout_s: float):
        self.watch = StallWatch(stall_timeout_s)
        self.pending: dict = {}  # ObjectRefGenerator -> _Call

    def add(self, stream, worker, tag, label: str, busy: bool = True) -> None:
        """Watch a call just submitted; ``busy``: its clock runs now (else from its first busy report)."""
        self.pending[stream] = _Call(tag, worker, label)
        self.watch.start(stream, time.monotonic(), busy)

    def wait(self, also: tuple = ()) -> list:
        """Calls with an item ready (and ready refs of ``also``), waiting at most until a call could stall."""
        refs = [*also, *self.pending]
        if not refs:
            return []
        ready, _ = ray.wait(refs, num_returns=1, timeout=self.watch.wait_s(time.monotonic()))
        return [r for r in ready if r in self.pending]

    def ready(self) -> list:
        """Calls with an item ready now."""
        if not self.pending:
            return []
        ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
        return ready

    def take(self, stream) -> dict | None:
        """The next item of ``stream``: None for a progress report, ``{"result": ...}`` when the call ended.

        Raises:
            RayTaskError, RayActorError: the call raised, or its worker died (the call ended).
        """
        try:
            item = ray.get(next(stream))
        except StopIteration:
            self.end(stream)
            raise RuntimeError(f"{self.pending_label(stream)}: the call ended without a result") from None
        except (RayTaskError, RayActorError):
            self.end(stream)
            raise
        if "result" in item:
            self.end(stream)
            return item
        self.watch.observe(stream, item, time.monotonic())
        return None

    def end(self, stream) -> _Call | None:
        self.watch.forget(stream)
        return self.pending.pop(stream, None)

    def pending_label(self, stream) -> str:
        call = self.pending.get(stream)
        return call.label if call else "a call"

    def kill_stalled(self) -> list[_Call]:
        """Kill (for a restart) the worker of every stalled call; its end arrives later as the worker's death."""
        now, killed = time.monotonic(), []
        for stream in self.watch.stalled(now):
            call = self.pending[stream]
            log.error("%s: no progress for rollout.stall_timeout_s=%gs (%s); restarting its worker", call.label,
                      self.watch.timeout_s, self.watch.describe(stream, now))  # fmt: skip
            ray.kill(call.worker, no_restart=False)
            self.watch.forget(stream)  # stays pending until the death arrives
            killed.append(call)
        return killed


class RolloutPool:
    """Rollout worker handles plus the newest broadcast weights (re-applied to restarted workers)."""

    def __init__(self, cfg: Config, workers: list):
        self.cfg, self.workers = cfg, list(workers)
        self.weights: tuple[int, object] | None = None  # (policy version, PackedWeights ref or a call making one)
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
        limit = self.cfg.rollout.restart_timeout_s
        deadline = time.monotonic() + limit
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
                if callable(self.weights[1]):  # exported when first needed (weight_sync.backend=collective)
                    self.weights = (self.weights[0], self.weights[1]())
                ray.get(worker.update_weights.remote(self.weights[1]), timeout=limit)
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
            Fault counters: ``worker_failures``, ``timeouts`` (calls killed as stalled), ``retries``.
        """
        return self._run(chunks, "generate_watched", on_result, "chunk")

    def evaluate(self, shares: list[dict]) -> tuple[list[dict], dict]:
        """Evaluate every share (:func:`~mugrpo_async.evaluation.shares.split_eval`) with the workers' current
        weights, a share per free worker, faults handled as for chunks (a lost share is evaluated again on
        the next free worker, restarted ones holding the newest broadcast weights).

        Returns:
            (``{benchmark: records}`` per share, in share order; the fault counters of :meth:`generate`).
        """
        results: list = [None] * len(shares)
        faults = self._run(dict(enumerate(shares)), "evaluate_watched", results.__setitem__, "evaluation share")
        return results, faults

    def _run(self, work: dict[int, object], method: str, on_result: Callable[[int, dict], None], what: str) -> dict:
        """Give out every item of ``work`` to ``worker.<method>`` calls until each result is accepted once."""
        r = self.cfg.rollout
        todo, free, calls = deque(sorted(work)), deque(self.workers), Watched(r.stall_timeout_s)
        attempts = dict.fromkeys(work, 0)
        faults = {"worker_failures": 0, "timeouts": 0, "retries": 0}
        while todo or calls.pending:
            while todo and free:
                k, w = todo.popleft(), free.popleft()
                calls.add(getattr(w, method).remote(work[k]), w, k, f"{what} {k}")
            if not calls.pending:
                raise RolloutFailed("no rollout worker is left alive (rollout.max_restarts="
                                    f"{r.max_restarts}); resume the run once the cluster is healthy")  # fmt: skip
            ready = calls.wait()
            if not ready:  # a call may have stalled: its worker is killed, its death handled below
                faults["timeouts"] += len(calls.kill_stalled())
                continue
            k, w = calls.pending[ready[0]].tag, calls.pending[ready[0]].worker
            try:
                item = calls.take(ready[0])
            except RayTaskError as err:  # the call raised (first: a task error may wrap another actor's death)
                attempts[k] += 1
                if attempts[k] > r.chunk_retries:
                    raise RolloutFailed(f"{what} {k} failed {attempts[k]} times; last error: {brief(err)}") from None
                faults["retries"] += 1
                log.warning("%s %d failed (%s); retry %d of %d", what, k, brief(err), attempts[k], r.chunk_retries)
                todo.appendleft(k)
                free.append(w)
                continue
            except RayActorError as err:  # the worker itself died (or was killed as stalled)
                faults["worker_failures"] += 1
                log.warning("%s %d: rollout worker died (%s); giving it out again", what, k, type(err).__name__)
                todo.appendleft(k)
                if self.heal(w):
                    free.append(w)
                continue
            if item is not None:  # the result (else a progress report)
                on_result(k, item["result"])
                free.append(w)
        return faults
