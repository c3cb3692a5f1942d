"""The driver's side of a weight sync: one object per run whose ``broadcast(version)`` publishes the trainer's
weights and loads them into every rollout engine, whatever the backend.

It drives the actors through a run (``drivers.run.Run``: ``trainers``, ``pool``, ``publish``, ``submit``,
``collect``) and imports Ray only inside its methods.
"""

from __future__ import annotations

import logging
import time

from mugrpo_async.weight_sync import backend_problems, resolve_backend

log = logging.getLogger(__name__)


class WeightSync:
    """``object_store``: rank 0's packed weights as one object ref, loaded by every worker
    (``RolloutPool.broadcast``)."""

    backend = "object_store"

    def __init__(self, run):
        self.run = run

    def broadcast(self, version: int) -> float:
        """Every rollout engine holds the trainer's current weights as policy ``version``; returns the seconds."""
        return self.run.pool.broadcast(self.run.publish(), version)

    def close(self) -> None:
        """Release what the backend holds (nothing here)."""


class CollectiveSync(WeightSync):
    """``collective``: trainer rank 0 broadcasts in buckets over a process group of its own to every engine.

    The group is formed at the first broadcast and again after a worker was restarted or lost. An engine whose
    load fails (it died, or a collective call timed out) is given the weights through the object store instead
    (a dead one once Ray has restarted it); the group is then formed anew at the next broadcast.
    """

    backend = "collective"

    def __init__(self, run):
        super().__init__(run)
        c = run.cfg
        self.transport = "nccl" if c.trainer.gpus_per_rank > 0 else "gloo"
        self.timeout_s = c.weight_sync.timeout_s
        self.sync_id, self.formed_for = 0, None

    def _members(self) -> tuple:
        pool = self.run.pool
        return pool.restarts, tuple(id(w) for w in pool.workers)

    def _form(self) -> None:
        import ray

        run, tp = self.run, self.run.cfg.rollout.tensor_parallel_size
        self.close()
        addr, port = ray.get(run.trainers[0].rendezvous_address.remote())
        world = 1 + len(run.pool.workers) * tp
        refs = [run.trainers[0].join_weight_group.remote(addr, port, world, self.transport)]
        refs += [w.join_weight_group.remote(addr, port, 1 + i * tp, world, self.transport)
                 for i, w in enumerate(run.pool.workers)]  # fmt: skip
        ray.get(refs, timeout=self.timeout_s + 30)
        self.formed_for = self._members()
        log.info("weight sync: %s group of trainer rank 0 and %d engine workers at %s:%d", self.transport,
                 world - 1, addr, port)  # fmt: skip

    def broadcast(self, version: int) -> float:
        import ray
        from ray.exceptions import RayActorError, RayError

        t0, run, pool = time.perf_counter(), self.run, self.run.pool
        if self.formed_for != self._members():
            self._form()
        self.sync_id += 1
        sends = run.submit("send_weights", self.sync_id)
        loads = {w.receive_weights.remote(self.sync_id): w for w in pool.workers}
        dead, failed = [], []
        for ref, worker in loads.items():
            try:
                ray.get(ref, timeout=4 * self.timeout_s)
            except RayActorError as err:
                log.warning("a rollout worker died during a collective weight sync (%s)", type(err).__name__)
                dead.append(worker)
            except (RayError, TimeoutError) as err:
                log.warning("a rollout worker failed a collective weight sync (%s)", _why(err))
                failed.append(worker)
        try:
            run.collect(sends, "send_weights")
        except RayError as err:
            if not (dead or failed):
                raise
            log.warning("trainer rank 0's collective send failed too (%s)", _why(err))
        pool.weights = (version, self._export_now)  # what a restarted worker is given, exported when asked
        if dead or failed:
            self._fall_back(version, dead, failed)
        return time.perf_counter() - t0

    def _export_now(self):
        return self.run.publish()

    def _fall_back(self, version: int, dead: list, failed: list) -> None:
        """After a failed collective sync: the group is formed anew next time, the failed engines load the weights
        through the object store (a dead one once restarted, :meth:`RolloutPool.heal`)."""
        import ray
        from ray.exceptions import RayActorError

        self.formed_for = None
        ref = self.run.publish()
        self.run.pool.weights = (version, ref)
        loads = {w.update_weights.remote(ref): w for w in failed}
        for load, worker in loads.items():
            try:
                ray.get(load)
            except RayActorError:  # died meanwhile: healed as the others
                dead.append(worker)
        for worker in dead:
            self.run.pool.heal(worker)  # a worker gone for good leaves the pool (its next call says so)

    def close(self) -> None:
        """Every member leaves the group (members that are gone are skipped)."""
        import ray

        if self.formed_for is None:
            return
        refs = [self.run.trainers[0].leave_weight_group.remote()]
        refs += [w.leave_weight_group.remote() for w in self.run.pool.workers]
        for ref in refs:
            try:
                ray.get(ref, timeout=30)
            except Exception:  # noqa: BLE001 - a member that is gone has left
                pass
        self.formed_for = None


def _why(err: BaseException) -> str:
    """A failed call in one line: for a task's error (``RayTaskError``) the error it wraps."""
    cause = getattr(err, "cause", None)
    inner = cause if isinstance(cause, BaseException) else err
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    return f"{type(inner).__name__}: {lines[0][:200]}" if lines else type(inner).__name__


def make_weight_sync(run) -> WeightSync:
    """The run's weight sync for ``weight_sync.backend`` (``auto`` resolved, :func:`resolve_backend`)."""
    c = run.cfg
    on_gpu = c.trainer.gpus_per_rank > 0
    backend = resolve_backend(c.weight_sync.backend, c.schedule.mode, on_gpu)
    problems = backend_problems(backend, c.schedule.mode, on_gpu)
    if problems:
        raise ValueError("; ".join(problems))
    return CollectiveSync(run) if backend == "collective" else WeightSync(run)
