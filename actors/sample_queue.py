"""Sample queue: the async mode's bounded-lag queue and weights board, as one async Ray actor.

A thin shell over :class:`mugrpo_async.staleness.LagQueue` (the rule and its accounting live there):
rollout workers ``reserve`` before generating (backpressure), ``put`` finished groups, and read the
newest published weights with ``latest``; the driver ``get``s one minibatch per update (blocking with a
timeout) and ``publish``es weights every ``sync_every`` updates. Queue depth, drops and the published
policy version are exported as ``ray.util.metrics`` gauges (Ray dashboard / Prometheus).
"""

from __future__ import annotations

import asyncio
import time

import ray

from actors.gauges import make_gauges
from mugrpo_async.staleness import LagQueue


@ray.remote(num_cpus=0)
class SampleQueue:
    """Bounded-lag FIFO of groups plus the latest weights ref (one object ref per version)."""

    def __init__(self, mu: int, groups_per_update: int, max_groups: int, run_name: str = "run"):
        self.q = LagQueue(mu=mu, groups_per_update=groups_per_update, max_groups=max_groups)
        self.changed = asyncio.Condition()
        self.version, self.weights, self.stopped = 0, None, False
        self.gauges = make_gauges({"queue_depth": "finished groups waiting", "queue_dropped": "groups over the lag cap",
                                   "policy_version": "latest published policy version"}, run_name)  # fmt: skip

    def _export(self) -> None:
        self.gauges["queue_depth"].set(len(self.q.queue))
        self.gauges["queue_dropped"].set(self.q.dropped)
        self.gauges["policy_version"].set(self.version)

    async def reserve(self, n: int, version: int) -> int:
        """Grant up to ``n`` groups to a worker holding ``version`` (0: wait for newer weights)."""
        return 0 if self.stopped else self.q.reserve(n, version)

    async def release(self, n: int) -> None:
        self.q.release(n)

    async def put(self, groups: list) -> int:
        async with self.changed:
            self.q.put(groups, [g.policy_version for g in groups])
            self._export()
            self.changed.notify_all()
        return len(self.q.queue)

    async def get(self, update: int, timeout_s: float) -> list | None:
        """B groups for update ``update`` (0-based), waiting up to ``timeout_s``; None on timeout."""
        deadline = time.monotonic() + timeout_s
        async with self.changed:
            while True:
                got = self.q.take(update)
                self._export()
                if got is not None:
                    return got[0]
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

    async def stats(self) -> dict:
        return {**self.q.stats(), "policy_version": self.version}
