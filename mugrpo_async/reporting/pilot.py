"""The learning-rate pilot's rules, fixed before its runs (docs/STUDY.md, "Learning-rate pilot"): when a GRPO mu = 4
run "improves steadily", when mu-GRPO's stage-0 veto fraction is "in range", and which rate the study then uses.

Run (a) of a rate is GRPO at mu = 4 over 1024 updates, evaluated on the held-out set every 64 updates (plus the
untrained policy once); run (b) is mu-GRPO over one fixed stage at mu = 1024, of which only ``nav_veto_frac`` per
update is read. Pure Python; :func:`rate_result` reads the records of a run folder (``metrics.jsonl``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mugrpo_async.reporting.verdicts import collapsed

RATES = ("3e-4", "1e-4", "3e-5")
"""The rates piloted first, each on seed :data:`SEED`, as given to ``trainer.lr`` (they name the run folders),
largest first: the first rate's mu-GRPO run generates the fixed stage."""

LOWER, HIGHER = 1e-5, 1e-3
"""Piloted only when the rules ask: :data:`LOWER` if no rate improves steadily, :data:`HIGHER` if every steady
rate vetoes under the range."""

SEED = 100
"""Not a study seed: the pilot's runs are never reused."""

VETO_RANGE = (0.002, 0.15)
"""The paper's range of the stage-0 veto fraction (Table 5): 0.2 % to 15 % of tokens."""

GAIN = 0.03
"""Run (a)'s last three points must average at least the untrained accuracy plus this."""

LAST = (896, 960, 1024)
EARLY, LATE = (64, 512), (576, 1024)


@dataclass
class RateResult:
    """What the pilot measured at one rate: run (a)'s held-out accuracy by update, the untrained accuracy, and run
    (b)'s mean veto fraction over its stage (None: that run has not finished)."""

    lr: float
    points: dict[int, float] = field(default_factory=dict)
    initial: float | None = None
    veto_frac: float | None = None

    @property
    def finished(self) -> bool:
        return bool(self.points) and max(self.points) >= LAST[-1] and self.veto_frac is not None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def improves_steadily(points: dict[int, float], initial: float) -> tuple[bool, list[str]]:
    """Run (a)'s three conditions; (all hold, the ones that failed, in words)."""
    missing = [u for u in LAST if u not in points]
    if missing:
        raise ValueError(f"run (a) has no held-out points at updates {missing}")
    failed = []
    last = _mean([points[u] for u in LAST])
    if last < initial + GAIN - 1e-12:
        failed.append(f"last three points average {last:.3f} < untrained {initial:.3f} + {GAIN}")
    series = [initial, *(points[u] for u in sorted(points))]
    if collapsed(series):
        failed.append(f"collapsed: final {series[-1]:.3f} <= peak {max(series):.3f} - 0.05")
    early = [a for u, a in points.items() if EARLY[0] <= u <= EARLY[1]]
    late = [a for u, a in points.items() if LATE[0] <= u <= LATE[1]]
    if early and late and _mean(late) < _mean(early):
        failed.append(f"updates {LATE[0]}-{LATE[1]} average {_mean(late):.3f} < updates {EARLY[0]}-{EARLY[1]} "
                      f"{_mean(early):.3f}")  # fmt: skip
    return not failed, failed


def veto_in_range(veto_frac: float) -> bool:
    return VETO_RANGE[0] <= veto_frac <= VETO_RANGE[1]


def decide(results: Sequence[RateResult]) -> dict:
    """The rate the study uses, or what to pilot next, by the design's rules.

    Returns:
        ``{"rate": float | None, "pilot_next": [rates], "veto_testable": bool | None, "why": str}``; ``rate`` None
        with ``pilot_next`` empty means the study stops (no rate improves steadily, 1e-5 included), or that runs
        are missing (``why`` names them).
    """
    waiting = [r.lr for r in results if not r.finished]
    if waiting:
        return _decision(None, [], None, f"runs not finished at lr {waiting}")
    piloted = {r.lr for r in results}
    steady = [r for r in results if improves_steadily(r.points, r.initial if r.initial is not None else 0.0)[0]]
    if not steady:
        if LOWER not in piloted:
            return _decision(None, [LOWER], None, "no rate improves steadily")
        return _decision(None, [], None, f"no rate improves steadily, {LOWER:g} included: the task does not support "
                         "the study")  # fmt: skip
    in_range = [r for r in steady if veto_in_range(r.veto_frac)]
    if in_range:
        best = max(in_range, key=lambda r: r.lr)
        return _decision(best.lr, [], True, f"the largest rate that improves steadily with its veto in range "
                         f"({best.veto_frac:.2%})")  # fmt: skip
    if all(r.veto_frac < VETO_RANGE[0] for r in steady) and HIGHER not in piloted:
        return _decision(None, [HIGHER], None, "every steady rate vetoes under 0.2 % of tokens")
    best = max(steady, key=lambda r: r.lr)
    testable = best.veto_frac >= VETO_RANGE[0]
    why = f"the largest rate that improves steadily; its veto {best.veto_frac:.2%} is outside the paper's range"
    return _decision(best.lr, [], testable, why + ("" if testable else ": the veto claims (C3-C5, C11) are not "
                                                   "testable here"))  # fmt: skip


def _decision(rate: float | None, pilot_next: list[float], veto_testable: bool | None, why: str) -> dict:
    return {"rate": rate, "pilot_next": pilot_next, "veto_testable": veto_testable, "why": why}


def rate_result(lr: float, run_a: list[dict] | None, run_b: list[dict] | None, initial: float | None) -> RateResult:
    """A :class:`RateResult` from the records of run (a) and run (b) (None: not started); only finished runs (an
    ``end`` record) count."""
    result = RateResult(lr, initial=initial)
    if run_a and any(r.get("kind") == "end" for r in run_a):
        result.points = {int(r["update"]): float(r["eval/mean"]) for r in run_a
                         if r.get("kind") == "eval" and "eval/mean" in r}  # fmt: skip
    if run_b and any(r.get("kind") == "end" for r in run_b):
        vetoes = {r["update"]: float(r["nav_veto_frac"]) for r in run_b  # a resumed run's newest record counts
                  if r.get("kind") == "update" and "nav_veto_frac" in r}  # fmt: skip
        result.veto_frac = _mean(list(vetoes.values())) if vetoes else None
    return result
