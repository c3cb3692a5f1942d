"""Sample queue: the async mode's bounded-lag queue and weights board, as one async Ray actor.

A thin shell over :class:`mugrpo_async.rollout.staleness.LagQueue` (the rule and its accounting live there):
rollout workers ``reserve`` before generating (backpressure), ``put`` finished groups, and read the
newest published weights with ``latest``; the driver ``get``s one minibatch per update (blocking with a
timeout) and ``publish``es weights every ``sync_every`` updates. With dynamic sampling (``max_refill_rounds``
set) equal-reward groups are filtered at ``put`` (the rule is the LagQueue's). Queue depth, drops, filtered
groups and the published policy version are exported as ``ray.util.metrics`` gauges (Ray dashboard / Prometheus).

Nothing produced is lost: every ``put`` is first written as a shard of ``rollouts/async/`` (the
store's writer, msgpack + checksums), and the queue then holds only where each group lies (its
`~mugrpo_async.rollout.shards.GroupRef`, its rewards and version): ``get`` reads the minibatch's groups back from
their shards, so a queue of (mu + 1) x B_mini groups costs its index, not its groups. A checkpoint takes a
:meth:`SampleQueue.snapshot` (counters and the queued refs); :meth:`SampleQueue.restore` queues those again plus
every group put after the snapshot, so a resumed run serves each group at most once and loses none. An evaluation
request taken by a worker that dies before finishing it is given back (:meth:`SampleQueue.release_worker`).
"""

from __future__ import annotations

import asyncio
import time

import ray

from actors.gauges import QUEUE_GAUGES, make_gauges
from mugrpo_async.rollout.dynamic_sampling import informative
from mugrpo_async.rollout.samples import SampleError, decode_groups, encode_groups
from mugrpo_async.rollout.shards import GroupRef, StageWriter, resolve
from mugrpo_async.rollout.staleness import LagQueue


@ray.remote(num_cpus=0)
class SampleQueue:
    """Bounded-lag FIFO of groups plus the latest weights ref (one object ref per version)."""

    def __init__(self, mu: int, groups_per_update: int, max_groups: int, run_name: str = "run",
                 store_dir: str | None = None, config_digest: str = "",
                 max_refill_rounds: int | None = None):  # fmt: skip
        self.q = LagQueue(mu=mu, groups_per_update=groups_per_update, max_groups=max_groups,
                          max_refill_rounds=max_refill_rounds)  # fmt: skip
        self.store = StageWriter.open(store_dir, "async", config_digest) if store_dir else None
        self.put_by_worker: dict[int, int] = {}  # groups each worker ever put (its prompt stream position)
        self.eval_requests: list[dict] = []  # evaluation work a worker takes between generation batches
        self.eval_taken: dict[int, tuple[int | None, dict]] = {}  # update -> (worker, request) not finished yet
        self.eval_done: list[tuple[int, dict, float]] = []
        self.changed = asyncio.Condition()
        self.version, self.weights, self.stopped = 0, None, False
        self.tokens = 0  # response tokens of every group put (the status line's and the dashboard's tokens/s)
        self.gauges = make_gauges(QUEUE_GAUGES, run_name)

    def _export(self) -> None:
        self.gauges["queue_depth"].set(len(self.q.queue))
        self.gauges["queue_dropped"].set(self.q.dropped)
        self.gauges["queue_filtered"].set(self.q.filtered)
        self.gauges["policy_version"].set(self.version)

    async def reserve(self, n: int, version: int, worker: int = 0) -> int:
        """Grant up to ``n`` groups to a worker holding ``version`` (0: wait for newer weights)."""
        return 0 if self.stopped else self.q.reserve(n, version, worker)

    async def release_worker(self, worker: int) -> int:
        """A worker died: give back what it had reserved and the evaluations it had taken; returns the groups.

        An evaluation taken without naming the worker is given back too (it may then run twice; the driver
        keeps the first result).
        """
        back = [request for taker, request in self.eval_taken.values() if taker in (worker, None)]
        for request in back:
            del self.eval_taken[request["update"]]
        self.eval_requests[:0] = back
        return self.q.release_worker(worker)

    async def put(self, groups: list, worker: int = 0) -> int:
        items = groups if self.store is None else self.store.add(groups)  # on disk before it can be served
        async with self.changed:
            self.q.put(items, [g.policy_version for g in groups], worker, self._informative(groups))
            self.put_by_worker[worker] = self.put_by_worker.get(worker, 0) + len(groups)
            self.tokens += sum(len(r) for g in groups for r in g.responses)
            self._export()
            self.changed.notify_all()
        return len(self.q.queue)

    def _informative(self, groups: list) -> list[bool] | None:
        return [informative(g) for g in groups] if self.q.bound else None

    async def get(self, update: int, timeout_s: float) -> list | None:
        """B groups for update ``update`` (0-based), waiting up to ``timeout_s``; None on timeout."""
        deadline = time.monotonic() + timeout_s
        async with self.changed:
            while True:
                got = self.q.take(update)
                self._export()
                if got is not None:
                    return resolve(got[0])  # read from their shards
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                try:
                    await asyncio.wait_for(self.changed.wait(), timeout=left)
                except asyncio.TimeoutError:
                    pass

    async def publish(self, version: int, weights: list) -> None:
        """Make ``weights[0]`` (an ObjectRef, wrapped so Ray does not resolve it) the newest policy."""
        self.version, self.weights = version, weights
        self._export()

    async def latest(self) -> tuple[int, list | None]:
        return self.version, self.weights

    async def stop(self) -> None:
        self.stopped = True

    async def is_stopped(self) -> bool:
        return self.stopped

    async def snapshot(self) -> dict:
        """Counters, the queued groups (their refs, or msgpack bytes without a store) and the shards written."""
        items = [g for _, g in self.q.queue]
        queued = {"queued_refs": [list(r) for r in items]} if self.store else {"queued": encode_groups(items)}
        return {"counters": self.q.stats(), "versions": [v for v, _ in self.q.queue], **queued,
                "shards": self.store.next_chunk() if self.store else 0,
                "bound": self.q.bound.state() if self.q.bound else None}  # fmt: skip

    async def restore(self, snapshot: dict | None) -> dict[int, int]:
        """Queue the snapshot's groups and every group put after it; returns groups put per worker."""
        snapshot = snapshot or {}
        if "queued_refs" in snapshot:  # each must be a group of a shard the store found good when it opened
            queued = [GroupRef(*r[:5], tuple(r[5]), *r[6:]) for r in snapshot["queued_refs"]]
            good = set(self.store.all_refs())
            lost = [r for r in queued if r not in good]
            if lost:
                raise SampleError(f"{lost[0].path}: {len(lost)} queued groups of the checkpoint are in no good "
                                  "shard of the store (damaged or missing)")  # fmt: skip
        else:  # a snapshot taken without a store (or before refs)
            queued = decode_groups(snapshot["queued"]) if snapshot else []
        start = snapshot.get("shards", 0)
        later = [r for c, rs in sorted(self.store.refs.items()) if c >= start for r in rs] if self.store else []
        counters = snapshot.get("counters", {"served": 0, "dropped": 0, "released": 0})
        self.q.restore(counters, queued, [g.policy_version for g in queued], snapshot.get("bound"))
        self.q.readmit(later, [g.policy_version for g in later], self._informative(later))  # filtered as they were
        self._export()
        for ref in self.store.all_refs() if self.store else []:
            self.put_by_worker[ref.worker] = self.put_by_worker.get(ref.worker, 0) + 1
        return dict(self.put_by_worker)

    async def put_by(self, worker: int) -> int:
        return self.put_by_worker.get(worker, 0)

    async def request_eval(self, request: dict) -> None:
        """Queue an evaluation: ``{"update", "weights": [ref], "benchmarks": {name: {prompts, n, ...}}}``."""
        self.eval_requests.append(request)

    async def next_eval(self, worker: int | None = None) -> dict | None:
        """The oldest evaluation request not taken yet, now taken by ``worker``; None when there is none."""
        if not self.eval_requests:
            return None
        request = self.eval_requests.pop(0)
        self.eval_taken[request["update"]] = (worker, request)
        return request

    async def finish_eval(self, update: int, records: dict, t_eval_s: float) -> None:
        self.eval_taken.pop(update, None)
        self.eval_done.append((update, records, t_eval_s))

    async def eval_results(self) -> list[tuple[int, dict, float]]:
        """Finished evaluations since the last call: (update, {benchmark: records}, seconds)."""
        out, self.eval_done = self.eval_done, []
        return out

    async def stats(self) -> dict:
        return {**self.q.stats(), "policy_version": self.version, "tokens": self.tokens}
