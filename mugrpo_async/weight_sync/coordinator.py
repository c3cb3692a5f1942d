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
    (a dead one once Ray has restarted it); the group is then formed anew at the next broadcast, unless engines
    failed (not died) in :attr:`GIVE_UP_AFTER` syncs in a row: the transport itself does not work here, and the
    run keeps to the object store.
    """

    backend = "collective"
    send, receive = "send_weights", "receive_weights"  # the actors' methods of a sync
    GIVE_UP_AFTER = 2

    def __init__(self, run):
        super().__init__(run)
        c = run.cfg
        self.transport = "nccl" if c.trainer.gpus_per_rank > 0 else "gloo"
        self.timeout_s = c.weight_sync.timeout_s
        self.sync_id, self.formed_for = 0, None
        self.failed_in_row, self.given_up = 0, False

    def _members(self) -> tuple:
        pool = self.run.pool
        return pool.restarts, tuple(id(w) for w in pool.workers)

    def _form(self) -> None:
        import ray

        self.close()
        addr, port = ray.get(self.run.trainers[0].rendezvous_address.remote())
        self._join(addr, port)
        self.formed_for = self._members()

    def _join(self, addr: str, port: int) -> None:
        """Every member joins the group served by trainer rank 0 at ``addr:port``."""
        import ray

        run, tp = self.run, self.run.cfg.rollout.tensor_parallel_size
        world = 1 + len(run.pool.workers) * tp
        refs = [run.trainers[0].join_weight_group.remote(addr, port, world, self.transport)]
        refs += [w.join_weight_group.remote(addr, port, 1 + i * tp, world, self.transport)
                 for i, w in enumerate(run.pool.workers)]  # fmt: skip
        ray.get(refs, timeout=self.timeout_s + 30)
        log.info("weight sync: %s group of trainer rank 0 and %d engine workers at %s:%d", self.transport,
                 world - 1, addr, port)  # fmt: skip

    def broadcast(self, version: int) -> float:
        """Every rollout engine holds the trainer's current weights as policy ``version``; returns the seconds. After
        :attr:`GIVE_UP_AFTER` syncs in a row in which an engine failed (not died), the run keeps to the object store
        (logged once)."""
        if self.given_up:
            return super().broadcast(version)
        t0 = time.perf_counter()
        failed = self._sync(version)
        self.failed_in_row = self.failed_in_row + 1 if failed else 0
        if self.failed_in_row >= self.GIVE_UP_AFTER:
            log.warning("weight sync: %s failed in %d syncs in a row; the run keeps to object_store from here",
                        self.backend, self.failed_in_row)  # fmt: skip
            self.close()
            self.given_up = True
        return time.perf_counter() - t0

    def _sync(self, version: int) -> bool:
        """One sync through the group, the failed engines' fallback included; whether an engine failed it."""
        import ray
        from ray.exceptions import RayActorError, RayError

        run, pool = self.run, self.run.pool
        if self.formed_for != self._members():
            self._form()
        self.sync_id += 1
        sends = run.submit(self.send, self.sync_id)
        loads = {getattr(w, self.receive).remote(self.sync_id): w for w in pool.workers}
        dead, failed = [], []
        for ref, worker in loads.items():
            try:
                ray.get(ref, timeout=4 * self.timeout_s)
            except RayActorError as err:
                log.warning("a rollout worker died during a %s weight sync (%s)", self.backend, type(err).__name__)
                dead.append(worker)
            except (RayError, TimeoutError) as err:
                log.warning("a rollout worker failed a %s weight sync (%s)", self.backend, _why(err))
                failed.append(worker)
        try:
            run.collect(sends, self.send)
        except RayError as err:
            if not (dead or failed):
                raise
            log.warning("the trainer's %s send failed too (%s)", self.backend, _why(err))
        pool.weights = (version, self._export_now)  # what a restarted worker is given, exported when asked
        if dead or failed:
            self._fall_back(version, dead, failed)
        return bool(failed)

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
        refs = [t.leave_weight_group.remote() for t in self._senders()]
        refs += [w.leave_weight_group.remote() for w in self.run.pool.workers]
        for ref in refs:
            try:
                ray.get(ref, timeout=30)
            except Exception:  # noqa: BLE001 - a member that is gone has left
                pass
        self.formed_for = None

    def _senders(self) -> list:
        return self.run.trainers[:1]


class IpcSync(CollectiveSync):
    """``cuda_ipc``: on colocated devices every trainer rank stages each bucket on its device and the engine worker
    of that device reads it through a handle (`mugrpo_async.weight_sync.ipc`); the store that orders them is served
    by trainer rank 0. Failures fall back as in :class:`CollectiveSync`."""

    backend = "cuda_ipc"
    send, receive = "send_weights_ipc", "receive_weights_ipc"

    def _join(self, addr: str, port: int) -> None:
        import ray

        run, tp = self.run, self.run.cfg.rollout.tensor_parallel_size
        served = ray.get(run.trainers[0].join_ipc.remote(addr, port), timeout=self.timeout_s + 30)
        refs = [t.join_ipc.remote(addr, port) for t in run.trainers[1:]]
        refs += [w.join_ipc.remote(addr, port, i * tp) for i, w in enumerate(run.pool.workers)]
        keys = ray.get(refs, timeout=self.timeout_s + 30)
        ranks, engines = [served, *keys[: len(run.trainers) - 1]], keys[len(run.trainers) - 1 :]
        alone = sorted({k for ks in engines for k in ks} - set(ranks))
        if alone:
            raise RuntimeError(f"weight_sync.backend=cuda_ipc: no trainer rank shares the device of engine workers "
                               f"{alone} (trainer ranks are on {ranks}); use placement.mode=colocated")  # fmt: skip
        log.info("weight sync: cuda_ipc over %d devices of %d trainer ranks and %d engine workers at %s:%d",
                 len(set(ranks)), len(ranks), sum(map(len, engines)), addr, port)  # fmt: skip

    def _senders(self) -> list:
        return list(self.run.trainers)


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
    colocated = c.placement.mode == "colocated"
    backend = resolve_backend(c.weight_sync.backend, c.schedule.mode, on_gpu, colocated)
    problems = backend_problems(backend, c.schedule.mode, on_gpu, colocated)
    if problems:
        raise ValueError("; ".join(problems))
    return {"collective": CollectiveSync, "cuda_ipc": IpcSync}.get(backend, WeightSync)(run)
