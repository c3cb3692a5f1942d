"""The study's pre-registered rules (mugrpo_async.reporting.verdicts) on hand-computed values."""

from __future__ import annotations

import math

import pytest

from mugrpo_async.reporting import verdicts as v

# Student's t, two-sided 95 %: the printed tables' values (e.g. Abramowitz & Stegun, table 26.10).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 9: 2.262, 30: 2.042}


@pytest.mark.parametrize("df,t", sorted(T_975.items()))
def test_t_critical_matches_the_tables(df, t):
    assert v.t_critical(df) == pytest.approx(t, abs=1e-3)


def test_t_central_cdf_closed_forms():
    # df 1: P(|T| <= t) = 2 atan(t) / pi; df 2: t / sqrt(2 + t^2)
    assert v.t_central_cdf(1.0, 1) == pytest.approx(0.5)
    assert v.t_central_cdf(2.0, 2) == pytest.approx(2 / math.sqrt(6))
    assert v.t_central_cdf(0.0, 5) == 0.0
    with pytest.raises(ValueError):
        v.t_central_cdf(1.0, 0)


def test_paired_interval_by_hand():
    a = {0: 0.30, 1: 0.25, 2: 0.40, 3: 0.35, 4: 0.20}
    b = {0: 0.20, 1: 0.20, 2: 0.30, 3: 0.30, 4: 0.10, 5: 0.99}  # seed 5 has no partner: left out
    iv = v.paired_interval(a, b)
    # d = 0.10, 0.05, 0.10, 0.05, 0.10: mean 0.08, sd sqrt(0.003 / 4) = 0.027386, se 0.012247, t(4) 2.776445
    assert iv.seeds == (0, 1, 2, 3, 4) and iv.n == 5
    assert iv.mean == pytest.approx(0.08)
    assert (iv.low, iv.high) == (pytest.approx(0.045996, abs=1e-6), pytest.approx(0.114004, abs=1e-6))
    assert v.interval_verdict(iv, +1) == v.REPRODUCED
    assert v.interval_verdict(iv, -1) == v.REFUTED


def test_interval_across_zero_is_not_decided():
    iv = v.paired_interval({0: 0.1, 1: 0.3}, {0: 0.2, 1: 0.1})  # d = -0.1, 0.2: mean 0.05, half 12.706 * 0.15
    assert iv.mean == pytest.approx(0.05) and iv.low == pytest.approx(0.05 - 12.7062 * 0.15, abs=1e-3)
    assert v.interval_verdict(iv, +1) == v.NOT_DECIDED == v.interval_verdict(iv, -1)


def test_interval_needs_two_finite_seeds():
    with pytest.raises(ValueError):
        v.paired_interval({0: 0.1, 1: math.nan}, {0: 0.0, 1: 0.0})
    with pytest.raises(ValueError):
        v.interval_verdict(v.mean_interval({0: 1.0, 1: 2.0}), 0)


def test_collapse_rule():
    assert v.collapsed([0.10, 0.30, 0.25])  # exactly peak - 0.05: collapsed (0.30 - 0.05 rounds below 0.25)
    assert not v.collapsed([0.10, 0.30, 0.26])
    assert v.collapsed([0.20, 0.18, 0.14])  # the untrained point is the peak: a run that only falls
    assert not v.collapsed([0.1, math.nan, 0.3])  # NaN points are skipped, the final is the last finite one
    with pytest.raises(ValueError):
        v.collapsed([math.nan])


def test_count_verdict_four_of_five():
    assert v.count_verdict([1, 1, 1, 1, 0], 4) == v.REPRODUCED
    assert v.count_verdict([1, 1, 1, 0, 0], 4) == v.NOT_DECIDED
    assert v.count_verdict([0, 0, 0, 0, 1], 4) == v.REFUTED
    assert v.count_verdict([1, 1, 0], 4) == v.NOT_DECIDED  # too few seeds either way


def test_noninferiority():
    within = v.Interval((0, 1, 2), (0, 0, 0), -0.01, -0.02, 0.00, 0.95)
    assert v.noninferiority_verdict(within) == v.REPRODUCED
    below = v.Interval((0, 1, 2), (0, 0, 0), -0.08, -0.10, -0.05, 0.95)
    assert v.noninferiority_verdict(below) == v.REFUTED
    wide = v.Interval((0, 1, 2), (0, 0, 0), -0.02, -0.06, 0.02, 0.95)
    assert v.noninferiority_verdict(wide) == v.NOT_DECIDED


def test_all_of():
    R, F, N, T = v.REPRODUCED, v.REFUTED, v.NOT_DECIDED, v.NOT_TESTABLE
    assert v.all_of([R, R]) == R and v.all_of([R, F, T]) == F and v.all_of([R, T]) == T and v.all_of([R, N]) == N


def test_claims_are_unique_and_well_formed():
    ids = [c.id for c in v.CLAIMS]
    assert len(ids) == len(set(ids))
    for c in v.CLAIMS:
        assert (c.other is not None) == (c.test in ("paired", "noninferior"))
        assert (c.at_least > 0) == (c.test == "count")
        assert all(r in ids[: ids.index(c.id)] for r in c.requires)


def _values(relaxed_collapses: list[bool]) -> dict:
    seeds = range(5)
    return {
        "collapsed": {"relaxed": dict(zip(seeds, relaxed_collapses))},
        "stable": {"mu_grpo": dict.fromkeys(seeds, True)},
        "final_acc": {"mu_grpo": {s: 0.30 + 0.01 * s for s in seeds}, "relaxed": {s: 0.10 for s in seeds}},
    }


def test_decide_all_applies_preconditions():
    out = v.decide_all(_values([True, True, True, True, False]))
    assert out["C2a"].verdict == v.REPRODUCED and out["C2a"].count == (4, 5)
    assert out["C5a"].verdict == v.REPRODUCED
    assert out["C5b"].verdict == v.REPRODUCED and out["C5b"].interval.mean == pytest.approx(0.22)
    assert out["C1a"].verdict == v.NOT_DECIDED and out["C1a"].interval is None  # no figures given
    # relaxed bounds did not collapse: stability under the veto is not testable, the paired claim still is
    out = v.decide_all(_values([False] * 5))
    assert out["C2a"].verdict == v.REFUTED
    assert out["C5a"].verdict == v.NOT_TESTABLE and out["C5a"].count == (5, 5)
    assert out["C5b"].verdict == v.REPRODUCED
    # two seeds of four collapsed: C2a is not decided yet, and C5a waits for it instead of being called untestable
    out = v.decide_all(_values([True, True, False, False]))
    assert out["C2a"].verdict == v.NOT_DECIDED
    assert out["C5a"].verdict == v.NOT_DECIDED and out["C5a"].waits_for == ("C2a",)
    assert out["C5a"].label == "not decided (waits for C2a)" and out["C5a"].count == (5, 5)
    assert out["C5b"].waits_for == ()


def test_an_interval_over_fewer_seeds_than_planned_is_interim():
    # C10 at 2 of its 3 seeds: the interval lies wholly below the margin, but a third seed could still move it
    two = {"final_acc": {"p2/mu_grpo": {0: 0.28, 1: 0.26}, "p2/grpo_mu4": {0: 0.74, 1: 0.77}}}
    d = v.decide_all(two)["C10"]
    assert d.interval.high < -v.NONINFERIORITY_MARGIN
    assert d.verdict == v.NOT_DECIDED and d.interim and d.label == "not decided (interim: 2 of 3 seeds)"
    three = {"final_acc": {k: {**s, 2: s[0]} for k, s in two["final_acc"].items()}}
    d = v.decide_all(three)["C10"]
    assert d.verdict == v.REFUTED and not d.interim and d.label == v.REFUTED
    # phase 1's claims are planned at 5 seeds: 4 leave C5b interim, counts are final as soon as they reach the bar
    out = v.decide_all(
        _values([True, True, True, True])
        | {"final_acc": {"mu_grpo": dict.fromkeys(range(4), 0.3), "relaxed": dict.fromkeys(range(4), 0.1)}}
    )
    assert out["C5b"].verdict == v.NOT_DECIDED and out["C5b"].interim
    assert out["C2a"].verdict == v.REPRODUCED
