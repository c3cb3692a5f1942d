"""The bounded-lag queue logic: capacity formula, lag cap, drops, conservation (no Ray)."""

import random

import pytest

from mugrpo_async.rollout.staleness import LagQueue, describe_lag_bound, lag_reach


def conserved(q: LagQueue) -> bool:
    s = q.stats()
    return s["admitted"] == s["served"] + s["dropped"] + s["queue_depth"] + s["in_flight"] + s["released"]


def test_capacity_formula_and_backpressure():
    q = LagQueue(mu=2, groups_per_update=4, max_groups=100)
    assert q.capacity(0) == (0 + 2 + 1) * 4  # 12 groups may be started on version 0
    assert q.reserve(20, 0) == 12 and q.reserve(1, 0) == 0  # the 13th must wait for newer weights
    assert q.reserve(5, 1) == 4  # version 1 buys one more update's worth
    q.release(4)
    assert q.in_flight == 12 and conserved(q)


def test_room_bounds_admission():
    q = LagQueue(mu=100, groups_per_update=2, max_groups=5)
    assert q.reserve(10, 0) == 5
    q.put(["a", "b", "c"], [0, 0, 0])
    assert q.capacity(0) == 0  # 3 queued + 2 in flight fill the 5 places
    assert q.take(0) == (["a", "b"], [0, 0])
    assert q.capacity(0) == 2


def test_grants_cut_short_are_counted_by_cause():
    q = LagQueue(mu=1, groups_per_update=2, max_groups=3)
    assert q.reserve(5, 0) == 3  # room 3 < lag budget 4: the queue's bound cut it
    assert q.stats()["blocked_room"] == 1 and q.stats()["blocked_lag"] == 0
    q.put(["a", "b", "c"], [0, 0, 0])
    q.take(0)  # room 2, lag budget 1: the cap cuts the next grant
    assert q.reserve(2, 0) == 1 and q.stats()["blocked_lag"] == 1
    assert q.reserve(1, 1) == 1 and q.stats()["blocked_lag"] == 1  # a full grant counts nothing


def test_the_lag_reaches_mu_only_when_the_queue_can_hold_that_many_updates():
    # B = 32, mu = 1024, sync_every = 4, 8 groups in flight: the old default (4 x B) keeps the lag near 9
    assert lag_reach(1024, 4, 4 * 32, 8, 32) == 4 + 5
    assert lag_reach(1024, 4, 1025 * 32, 8, 32) == 1024  # the default (mu + 1) x B lets the cap bind
    assert "the cap binds" in describe_lag_bound(8, 2, 9 * 2, 4, 2)
    line = describe_lag_bound(1024, 4, 128, 8, 32)
    assert "below about 9 updates" in line and "schedule.queue_max_groups=32800" in line


def test_take_is_fifo_and_drops_over_age_groups():
    q = LagQueue(mu=1, groups_per_update=2, max_groups=10)
    assert q.reserve(6, 0) == 4  # (0 + 1 + 1) * 2
    q.put(["a", "b", "c", "d"], [0, 0, 0, 0])
    assert q.take(0) == (["a", "b"], [0, 0])
    assert q.reserve(2, 1) == 2
    q.put(["e", "f"], [1, 1])
    # at update 2, c and d (version 0, lag 2 > mu = 1) are dropped wherever they sit; e, f are served
    assert q.take(2) == (["e", "f"], [1, 1])
    assert q.stats()["dropped"] == 2 and q.stats()["queue_depth"] == 0 and conserved(q)


def test_put_and_release_cannot_exceed_reservations():
    q = LagQueue(mu=4, groups_per_update=1, max_groups=10)
    q.reserve(1, 0)
    with pytest.raises(ValueError):
        q.put(["a", "b"], [0, 0])
    with pytest.raises(ValueError):
        q.release(2)


@pytest.mark.parametrize("seed", range(20))
def test_random_schedule_never_serves_over_the_cap(seed):
    """Workers of random speed, trainer publishing every sync_every updates: lag <= mu, all counted."""
    rng = random.Random(seed)
    mu, B, sync_every = rng.choice([2, 4, 8]), rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
    q = LagQueue(mu=mu, groups_per_update=B, max_groups=rng.choice([4, 16, 64]))
    workers = [{"version": 0, "pending": []} for _ in range(3)]
    published, update, lags = 0, 0, []
    for _ in range(600):
        w = rng.choice(workers)
        if w["pending"] and rng.random() < 0.5:  # finish a batch
            q.put([object() for _ in w["pending"]], w["pending"])
            w["pending"] = []
        elif not w["pending"]:
            w["version"] = published  # pick up the newest weights between batches
            w["pending"] = [w["version"]] * q.reserve(rng.randint(1, 3), w["version"])
        got = q.take(update) if rng.random() < 0.4 else None
        if got:
            lags += [update - v for v in got[1]]
            update += 1
            if update % sync_every == 0:
                published = update
        assert conserved(q)
    assert len(lags) == q.stats()["served"] == B * update > 0 and max(lags) <= mu
