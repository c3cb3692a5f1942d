"""The staleness study's rules, fixed before its runs: paired per-seed differences with a 95 % t interval, collapse
of an accuracy series, and a verdict per claim of the paper (docs/STUDY.md, "Design of the study at the paper's
regime").

Pure Python (no numpy, no Ray, no scipy): Student's t quantile comes from the closed form of its CDF for integer
degrees of freedom. The per-seed figures a claim is decided on (``final_acc``, ``collapsed``, ...) are computed
elsewhere from the run folders; this module only holds the rules and the list of claims, so that the list in the
design and the verdicts in the report cannot drift apart.

Verdicts: ``reproduced`` (the interval clears 0 in the claimed direction, or the count reaches its bar),
``refuted`` (it clears 0 the other way, or the count reaches the bar against the claim), ``not decided``
(neither), ``not testable here`` (a claim it presupposes was refuted or is itself not testable). A claim whose
presupposed claim is only ``not decided`` yet is ``not decided`` too, and its :class:`Decision` names the claims it
waits for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

CONFIDENCE = 0.95
"""Two-sided confidence of every interval."""

COLLAPSE_MARGIN = 0.05
"""A run collapsed when its final held-out accuracy is at most its peak minus this."""

NONINFERIORITY_MARGIN = 0.03
"""A "matches" claim holds when the lower end of (claimed - reference) lies above minus this."""

REPRODUCED, REFUTED, NOT_DECIDED, NOT_TESTABLE = "reproduced", "refuted", "not decided", "not testable here"

_TOL = 1e-12  # a figure exactly at a bar counts as reaching it despite float rounding (0.30 - 0.05 < 0.25)


def t_central_cdf(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with ``df`` >= 1 degrees of freedom (Abramowitz & Stegun 26.7.3-4)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if t <= 0:
        return 0.0
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:  # sin(theta) * (1 + c2/2 + (1*3)/(2*4) c2^2 + ... up to c2^((df-2)/2))
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return min(1.0, s * total)
    term, total = 1.0, 0.0  # (2/pi) (theta + sin cos (1 + (2/3) c2 + ... up to c2^((df-3)/2)))
    if df > 1:
        total = 1.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
    return min(1.0, 2.0 / math.pi * (theta + s * math.cos(theta) * total))


def t_critical(df: int, confidence: float = CONFIDENCE) -> float:
    """The t with P(|T| <= t) = ``confidence`` (df 4, 0.95: 2.776), by bisection to float precision."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    lo, hi = 0.0, 1.0
    while t_central_cdf(hi, df) < confidence:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_central_cdf(mid, df) < confidence else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Interval:
    """A mean over seeds with its t interval.

    Attributes:
        seeds: The seeds used, ascending.
        values: One value per seed (for a paired comparison, ``a[s] - b[s]``).
        mean / low / high: The mean and the ends of its two-sided ``confidence`` interval.
        confidence: e.g. 0.95.
    """

    seeds: tuple[int, ...]
    values: tuple[float, ...]
    mean: float
    low: float
    high: float
    confidence: float

    @property
    def n(self) -> int:
        return len(self.values)


def mean_interval(values: Mapping[int, float], confidence: float = CONFIDENCE) -> Interval:
    """The t interval of the mean of per-seed ``values`` (non-finite values left out).

    Raises:
        ValueError: with fewer than two finite values (no spread to estimate).
    """
    seeds = sorted(s for s, v in values.items() if v is not None and math.isfinite(v))
    if len(seeds) < 2:
        raise ValueError(f"an interval needs at least 2 seeds with finite values, got {len(seeds)}")
    x = [float(values[s]) for s in seeds]
    n = len(x)
    mean = math.fsum(x) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in x) / (n - 1))
    half = t_critical(n - 1, confidence) * sd / math.sqrt(n)
    return Interval(tuple(seeds), tuple(x), mean, mean - half, mean + half, confidence)


def paired_interval(a: Mapping[int, float], b: Mapping[int, float], confidence: float = CONFIDENCE) -> Interval:
    """The t interval of the mean per-seed difference ``a[s] - b[s]`` over the seeds both arms have."""
    both = set(a) & set(b)
    return mean_interval({s: a[s] - b[s] for s in both if a[s] is not None and b[s] is not None}, confidence)


def collapsed(series: Sequence[float], margin: float = COLLAPSE_MARGIN) -> bool:
    """Whether an accuracy series (in update order) ends at most ``margin`` below its peak.

    The study's series start with the untrained policy's accuracy, so a run that only falls counts as well.

    Raises:
        ValueError: for a series without finite values.
    """
    x = [float(v) for v in series if v is not None and math.isfinite(v)]
    if not x:
        raise ValueError("collapse needs at least one finite accuracy")
    return max(x) - x[-1] >= margin - _TOL


def interval_verdict(iv: Interval, direction: int = 1) -> str:
    """``reproduced`` if the interval clears 0 in ``direction`` (+1: above, -1: below), ``refuted`` if it clears
    0 the other way, else ``not decided``."""
    if direction not in (1, -1):
        raise ValueError(f"direction must be +1 or -1, got {direction}")
    low, high = (iv.low, iv.high) if direction == 1 else (-iv.high, -iv.low)
    return REPRODUCED if low > 0 else REFUTED if high < 0 else NOT_DECIDED


def noninferiority_verdict(iv: Interval, margin: float = NONINFERIORITY_MARGIN) -> str:
    """A "matches" claim, on (claimed - reference): ``reproduced`` if the whole interval lies above ``-margin``,
    ``refuted`` if it lies below ``-margin``, else ``not decided``."""
    return REPRODUCED if iv.low > -margin else REFUTED if iv.high < -margin else NOT_DECIDED


def count_verdict(flags: Iterable[bool], at_least: int) -> str:
    """``reproduced`` if at least ``at_least`` seeds show the claimed event, ``refuted`` if at least ``at_least``
    do not (4 of 5: reproduced at 4-5, refuted at 0-1), else ``not decided``."""
    flags = [bool(f) for f in flags]
    hits = sum(flags)
    return REPRODUCED if hits >= at_least else REFUTED if len(flags) - hits >= at_least else NOT_DECIDED


def all_of(verdicts: Iterable[str]) -> str:
    """A claim made of parts: refuted if a part is, reproduced if every part is, else not testable if a part is,
    else not decided."""
    vs = list(verdicts)
    if REFUTED in vs:
        return REFUTED
    if vs and all(v == REPRODUCED for v in vs):
        return REPRODUCED
    return NOT_TESTABLE if NOT_TESTABLE in vs else NOT_DECIDED


Test = Literal["paired", "mean", "count", "noninferior"]


@dataclass(frozen=True)
class Claim:
    """One test set in advance.

    Attributes:
        id: Short key, e.g. ``"C2a"``.
        text: The paper's claim in one line.
        test: ``paired`` (``metric`` of ``arm`` minus ``other``, per seed), ``mean`` (``metric`` of ``arm`` is
            already a per-seed difference), ``count`` (``metric`` is a per-seed bool; ``at_least`` seeds),
            ``noninferior`` (``arm`` minus ``other`` above ``-NONINFERIORITY_MARGIN``).
        metric: The per-seed figure (docs/STUDY.md defines each).
        arm / other: Arm names (``other`` only for ``paired`` and ``noninferior``).
        direction: +1 if the claim says ``arm`` is higher (or the figure positive), -1 if lower.
        at_least: ``count``: seeds needed.
        requires: Claims that must be reproduced for this one to be testable.
        seeds: The seeds the design runs for it. An interval over fewer stays ``not decided`` (interim): one
            more seed can move it either way. A count needs no such bar, as its verdict cannot be undone.
    """

    id: str
    text: str
    test: Test
    metric: str
    arm: str
    other: str | None = None
    direction: int = 1
    at_least: int = 0
    requires: tuple[str, ...] = ()
    seeds: int = 5


def _c(id_: str, text: str, test: Test, metric: str, arm: str, other: str | None = None, **kw) -> Claim:
    return Claim(id_, text, test, metric, arm, other, **kw)


_P1_COLLAPSE = ("C2a",)  # stability under a veto says something only where relaxed bounds collapse
CLAIMS: tuple[Claim, ...] = (
    _c("C1a", "tight clipping: its clip fraction rises over the stage", "mean", "clip_rise", "grpo"),
    _c("C1b", "tight clipping stays below relaxed bounds' peak", "paired", "peak_acc", "relaxed", "grpo"),
    _c("C2a", "relaxed [0, 5] without veto collapses (4 of 5 seeds)", "count", "collapsed", "relaxed", at_least=4),
    _c("C2b", "relaxed [0, 5] learns faster at first than tight clipping", "paired", "acc_256", "relaxed", "grpo"),
    _c("C3", "masking only the trigger tokens still collapses (4 of 5 seeds)", "count", "collapsed", "veto_trigger",
       at_least=4),
    _c("C4a", "H_kappa keeps training stable (4 of 5 seeds)", "count", "stable", "veto_suffix_nontrigger",
       at_least=4, requires=_P1_COLLAPSE),
    _c("C4b", "H_kappa ends above relaxed without veto", "paired", "final_acc", "veto_suffix_nontrigger", "relaxed"),
    _c("C4c", "S_kappa keeps training stable (4 of 5 seeds)", "count", "stable", "veto_suffix", at_least=4,
       requires=_P1_COLLAPSE),
    _c("C4d", "S_kappa ends above relaxed without veto", "paired", "final_acc", "veto_suffix", "relaxed"),
    _c("C5a", "mu-GRPO (S_seq) keeps training stable (4 of 5 seeds)", "count", "stable", "mu_grpo", at_least=4,
       requires=_P1_COLLAPSE),
    _c("C5b", "mu-GRPO ends above relaxed without veto", "paired", "final_acc", "mu_grpo", "relaxed"),
    _c("C6a", "on the fixed set accuracy rises with mu: B_mini 16 (mu 1024) above 64 (mu 256)", "paired",
       "final_acc", "mu_grpo@16", "mu_grpo@64", seeds=3),
    _c("C6b", "on the fixed set accuracy rises with mu: B_mini 64 (mu 256) above 256 (mu 64)", "paired",
       "final_acc", "mu_grpo@64", "mu_grpo@256", seeds=3),
    _c("C7", "tight clipping at high staleness ends below GRPO at mu = 4", "paired", "final_acc", "p2/grpo_mu4",
       "p2/grpo", seeds=3),
    _c("C8", "relaxed [0, 5] collapses over 4 stages (3 of 3 seeds)", "count", "collapsed", "p2/relaxed",
       at_least=3),
    _c("C9", "mu-GRPO ends above relaxed over 4 stages", "paired", "final_acc", "p2/mu_grpo", "p2/relaxed",
       seeds=3),
    _c("C10", "mu-GRPO at mu = 256 matches GRPO at mu = 4", "noninferior", "final_acc", "p2/mu_grpo",
       "p2/grpo_mu4", seeds=3),
    _c("C11", "the veto fires mostly in stage 0 (Table 5)", "mean", "veto_drop", "p2/mu_grpo", seeds=3),
)  # fmt: skip
"""The pre-registered claims, in the order of docs/STUDY.md; arms ``p2/...`` are phase 2's, ``...@B`` the
B_mini sweep's (3 seeds), the others phase 1's."""


Values = Mapping[str, Mapping[str, Mapping[int, float]]]
"""metric -> arm -> seed -> value (bools for ``collapsed`` / ``stable``)."""


@dataclass(frozen=True)
class Decision:
    """A claim's verdict with what it rests on: the interval (``paired``, ``mean``, ``noninferior``) or the
    seeds showing the event out of those run (``count``)."""

    claim: Claim
    verdict: str
    interval: Interval | None = None
    count: tuple[int, int] | None = None
    waits_for: tuple[str, ...] = ()
    """The presupposed claims still ``not decided`` that keep this one ``not decided`` (empty otherwise)."""

    @property
    def interim(self) -> bool:
        """An interval over fewer seeds than the design runs for the claim: no verdict yet."""
        return self.interval is not None and self.interval.n < self.claim.seeds

    @property
    def label(self) -> str:
        """The verdict as the report writes it: ``not decided (waits for C2a)`` where it waits for a claim,
        ``not decided (interim: 2 of 3 seeds)`` where its interval lacks seeds."""
        if self.waits_for:
            return f"{self.verdict} (waits for {', '.join(self.waits_for)})"
        if self.interim:
            return f"{self.verdict} (interim: {self.interval.n} of {self.claim.seeds} seeds)"
        return self.verdict


def decide(claim: Claim, values: Values) -> Decision:
    """The verdict of one claim from the per-seed figures (``not decided`` where its figures are missing or
    fewer than ``claim.seeds`` seeds have them; preconditions are :func:`decide_all`'s)."""
    arms = values.get(claim.metric, {})
    if claim.test == "count":
        flags = [bool(v) for _, v in sorted(arms.get(claim.arm, {}).items())]
        return Decision(claim, count_verdict(flags, claim.at_least), count=(sum(flags), len(flags)))
    try:
        if claim.test == "mean":
            iv = mean_interval(arms.get(claim.arm, {}))
        else:
            iv = paired_interval(arms.get(claim.arm, {}), arms.get(claim.other or "", {}))
    except ValueError:
        return Decision(claim, NOT_DECIDED)
    verdict = noninferiority_verdict(iv) if claim.test == "noninferior" else interval_verdict(iv, claim.direction)
    decision = Decision(claim, verdict, iv)
    return replace(decision, verdict=NOT_DECIDED) if decision.interim else decision


def decide_all(values: Values, claims: Sequence[Claim] = CLAIMS) -> dict[str, Decision]:
    """Every claim's :class:`Decision` (its interval or count is always given). A claim whose ``requires`` include
    one refuted or not testable is ``not testable here``; else, one that includes a claim still ``not decided`` is
    ``not decided`` and waits for it (a verdict of its own figures would presuppose what is not known yet)."""
    out: dict[str, Decision] = {}
    for claim in claims:
        d = decide(claim, values)
        required = [out[r].verdict if r in out else NOT_TESTABLE for r in claim.requires]
        if any(v in (REFUTED, NOT_TESTABLE) for v in required):
            d = Decision(claim, NOT_TESTABLE, d.interval, d.count)
        elif NOT_DECIDED in required:
            waits = tuple(r for r, v in zip(claim.requires, required) if v == NOT_DECIDED)
            d = Decision(claim, NOT_DECIDED, d.interval, d.count, waits_for=waits)
        out[claim.id] = d
    return out
