"""Dynamic sampling in async mode: the sample queue's equal-reward filter, its lag budget and its per-version bound
(hand-computed cases and a random schedule, no Ray)."""

from __future__ import annotations

import json
import random

import pytest

from mugrpo_async.config import load_config
from mugrpo_async.reporting.status import RunStatus, StatusBoard, format_status, status_from_records
from mugrpo_async.rollout.dynamic_sampling import VersionBound
from mugrpo_async.rollout.staleness import LagQueue


def conserved(q: LagQueue) -> bool:
    s = q.stats()
    return s["admitted"] == (s["served"] + s["dropped"] + s["groups_filtered"] + s["queue_depth"] + s["in_flight"]
                             + s["released"])  # fmt: skip


def test_filtered_groups_leave_the_lag_budget_until_the_version_bound():
    q = LagQueue(mu=1, groups_per_update=2, max_groups=100, max_refill_rounds=1)  # bound (1 + 1) * 2 = 4 per version
    assert q.reserve(9, 0) == 4  # (0 + 1 + 1) * 2
    q.put(["a", "b", "c", "d"], [0] * 4, informative=[True, False, False, True])
    assert list(q.queue) == [(0, "a"), (0, "d")] and q.filtered == 2
    assert q.capacity(0) == 4 - (4 - 2)  # b and c gave their places back: the refill
    assert q.reserve(9, 0) == 2
    q.put(["e", "f"], [0, 0], informative=[False, True])  # the 5th group of version 0 is past the bound: kept
    s = q.stats()
    assert [x for _, x in q.queue] == ["a", "d", "e", "f"] and (s["groups_filtered"], s["groups_short"]) == (2, 1)
    assert q.capacity(0) == 0 and conserved(q)
    assert q.take(0) == (["a", "d"], [0, 0]) and q.take(1) == (["e", "f"], [0, 0])
    assert q.reserve(9, 1) == 2 and q.reserve(9, 2) == 2  # a new version counts its own groups from 0
    q.put(["g", "h", "i", "j"], [2] * 4, informative=[False] * 4)
    assert q.filtered == 6 and q.bound.generated == {0: 6, 2: 4} and len(q.queue) == 0 and conserved(q)


def test_without_dynamic_sampling_nothing_is_filtered():
    q = LagQueue(mu=1, groups_per_update=2, max_groups=100)
    q.reserve(4, 0)
    q.put(["a", "b", "c", "d"], [0] * 4, informative=[False] * 4)
    s = q.stats()
    assert s["queue_depth"] == 4 and (s["groups_filtered"], s["groups_short"]) == (0, 0) and q.capacity(0) == 0


def test_nothing_informative_still_trains_at_the_bound():
    """One worker, every group equal-reward: per version the first (1 + R) * B are filtered, the rest served."""
    mu, B, R, sync_every = 2, 2, 1, 2
    q = LagQueue(mu=mu, groups_per_update=B, max_groups=64, max_refill_rounds=R)
    version, update, lags = 0, 0, []
    for _ in range(200):
        n = q.reserve(3, version)
        q.put([object()] * n, [version] * n, informative=[False] * n)
        while got := q.take(update):
            lags += [update - v for v in got[1]]
            update += 1
            if update % sync_every == 0:
                version = update  # the worker picks the newest weights up before its next batch
        assert conserved(q)
        if update >= 8:
            break
    s = q.stats()
    assert update == 8 and max(lags) <= mu and s["served"] == 16
    # versions 0, 2, 4, 6 each had 4 groups filtered; every served group was one of the short ones
    assert s["groups_filtered"] == 4 * 4 and s["groups_short"] == s["served"] + s["queue_depth"] + s["dropped"]


@pytest.mark.parametrize("seed", range(20))
def test_random_schedule_filters_until_the_bound_and_keeps_the_cap(seed):
    """Workers of random speed and informative shares: lag <= mu, every group counted, and an equal-reward group is
    served only once its version has generated its (1 + R) * B groups."""
    rng = random.Random(seed)
    mu, B, R, sync_every = rng.choice([2, 4, 8]), rng.choice([1, 2, 4]), rng.choice([0, 1, 3]), rng.choice([1, 2])
    share = rng.choice([0.0, 0.3, 1.0])
    q = LagQueue(mu=mu, groups_per_update=B, max_groups=rng.choice([8, 64]), max_refill_rounds=R)
    workers = [{"version": 0, "pending": []} for _ in range(3)]
    seen: dict[int, int] = {}  # groups put per version, never forgotten
    published, update, served = 0, 0, []
    for _ in range(800):
        w = rng.choice(workers)
        if w["pending"] and rng.random() < 0.5:
            items = []
            for v in w["pending"]:
                seen[v] = seen.get(v, 0) + 1
                items.append({"v": v, "informative": rng.random() < share, "nth": seen[v]})
            q.put(items, w["pending"], informative=[x["informative"] for x in items])
            w["pending"] = []
        elif not w["pending"]:
            w["version"] = published
            w["pending"] = [w["version"]] * q.reserve(rng.randint(1, 3), w["version"])
        got = q.take(update) if rng.random() < 0.4 else None
        if got:
            served += [(update, x) for x in got[0]]
            update += 1
            if update % sync_every == 0:
                published = update
        assert conserved(q)
    assert len(served) == q.stats()["served"] == B * update > 0
    assert all(u - x["v"] <= mu for u, x in served)
    assert all(x["informative"] or x["nth"] > (1 + R) * B for _, x in served)
    if share == 1.0:
        assert q.filtered == q.stats()["groups_short"] == 0


def test_restore_filters_the_later_groups_as_they_were():
    """A snapshot, then groups put after it: restoring both gives the queue and the counts the run had."""
    q = LagQueue(mu=4, groups_per_update=2, max_groups=100, max_refill_rounds=1)
    q.reserve(12, 0)
    q.put(list("abc"), [0] * 3, informative=[False, True, False])
    snap = json.loads(json.dumps({"counters": q.stats(), "queued": [x for _, x in q.queue], "bound": q.bound.state()}))
    later, flags = list("defgh"), [False, False, True, False, False]  # d: 4th of version 0, filtered; e, g, h short
    q.put(later, [0] * 5, informative=flags)
    r = LagQueue(mu=4, groups_per_update=2, max_groups=100, max_refill_rounds=1)
    r.restore(snap["counters"], snap["queued"], [0] * len(snap["queued"]), snap["bound"])
    r.readmit(later, [0] * 5, flags)
    assert list(r.queue) == list(q.queue) == [(0, x) for x in "befgh"]
    counts = (q.filtered, q.bound.short, q.bound.generated)
    assert (r.filtered, r.bound.short, r.bound.generated) == counts == (3, 3, {0: 8})
    assert conserved(r) and r.stats()["put"] == q.stats()["put"] == 8
    old = LagQueue(mu=4, groups_per_update=2, max_groups=100, max_refill_rounds=1)  # a snapshot from before the filter
    old.restore({"served": 2, "dropped": 0, "released": 0}, ["x"], [0], None)
    assert old.filtered == 0 and old.stats()["put"] == 3 and conserved(old)


def test_version_bound_forgets_versions_that_can_no_longer_be_served():
    b = VersionBound(limit=1)
    assert [b.admit(0, False), b.admit(0, False), b.admit(3, True)] == [False, True, True]
    b.forget_before(3)
    assert b.generated == {3: 1} and b.short_by == {} and (b.filtered, b.short) == (1, 1)


def test_async_dynamic_sampling_is_accepted_and_counted_on_the_status_line(tmp_path):
    cfg = load_config(None, ["rollout.dynamic_sampling=true", "schedule.mode=async", "schedule.mu=4"])
    assert cfg.rollout.dynamic_sampling and cfg.schedule.mode == "async"
    status = RunStatus(run="r", mode="async", total_updates=4, groups_per_update=2)
    board = StatusBoard(status, tmp_path, 0, lambda line: None, lambda: 1.0)
    board.set_queue({"put": 9, "served": 4, "dropped": 1, "groups_filtered": 3, "queue_depth": 1})
    assert "groups generated 9 served 4 dropped 1 filtered 3" in format_status(board.snapshot())
    end = {"kind": "end", "T_total": 1.0, "generated": 9, "served": 4, "dropped": 1, "groups_filtered": 3}
    assert status_from_records([end], "r", "async", 2, 4).filtered == 3
    assert "filtered" not in format_status(RunStatus(run="r", mode="sync", total_updates=4, groups_per_update=2))
