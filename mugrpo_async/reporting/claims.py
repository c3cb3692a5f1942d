"""The study report's claims table: the per-seed figures the pre-registered claims are decided on, computed from
run folders, and the table of :func:`mugrpo_async.reporting.verdicts.decide_all`'s verdicts. Pure: no Ray.

Per-seed figures of one run (docs/STUDY.md, "Rules set in advance"), held-out accuracy only (``eval/mean``; a run
without eval records has none of the accuracy figures):

- ``final_acc``: the accuracy at the run's last evaluation;
- ``peak_acc``: the largest accuracy of the run, the untrained policy's point of that seed included (when
  ``launch.study`` measured it: ``<out>/initial/seed-<s>.json``);
- ``collapsed``: ``final_acc <= peak_acc - 0.05`` (:func:`~mugrpo_async.reporting.verdicts.collapsed`);
  ``stable`` is its negation;
- ``acc_256``: the accuracy at update :data:`EARLY_UPDATE`;
- ``clip_rise``: mean ``clip_frac`` over the run's last quarter of updates minus its mean over its first
  sixteenth (updates 769-1024 and 1-64 of a 1024-update run);
- ``veto_drop``: mean ``nav_veto_frac`` over stage 0 minus its mean over the later stages;
- ``late_acc``: the mean of the run's last :data:`LATE_POINTS` evaluations. Chosen after the data were seen (the
  held-out accuracy swings by 0.1 between neighbouring points at lr 3e-4), so it is descriptive only: no claim reads
  it, and :func:`late_table` reports it apart from the verdicts.

Arm names (:data:`~mugrpo_async.reporting.verdicts.CLAIMS`): a run of variant ``v`` counts as arm ``<prefix>v``
and ``<prefix>v@<B_mini>``; the prefix is empty for phase 1 and ``p2/`` for phase 2, so one study folder per
phase (and per B_mini of the sweep) feeds one table.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from mugrpo_async.reporting.study import RunData, accuracy_points, per_stage
from mugrpo_async.reporting.study_tables import markdown_table
from mugrpo_async.reporting.verdicts import (
    CLAIMS,
    COLLAPSE_MARGIN,
    NONINFERIORITY_MARGIN,
    Claim,
    Decision,
    collapsed,
    decide_all,
)

EARLY_UPDATE = 256
"""``acc_256``: the update of the early accuracy (4,096 groups at B_mini = 16)."""

LATE_POINTS = 3
"""``late_acc``: how many of the last evaluations it averages."""

FIGURES = ("final_acc", "peak_acc", "collapsed", "stable", "acc_256", "clip_rise", "veto_drop", "late_acc")


def _mean_over(run: RunData, key: str, low: float, high: float) -> float:
    """Mean of update metric ``key`` over the updates u with ``low < u <= high`` (NaN where none)."""
    x = [r.get(key, math.nan) for r in run.updates if low < r["update"] <= high]
    return float(np.mean(x)) if x else math.nan


def seed_figures(run: RunData) -> dict[str, Any]:
    """The per-seed figures of one run (:data:`FIGURES`; NaN / None where the run lacks what one needs)."""
    source, pts = accuracy_points(run)
    acc = {u: a for u, _, a in pts if a is not None and math.isfinite(a)} if source == "eval" else {}
    series = ([run.initial] if run.initial is not None else []) + [acc[u] for u in sorted(acc)]
    total = run.config["schedule"]["total_updates"]
    stages = per_stage(run, "nav_veto_frac")
    out: dict[str, Any] = {
        "final_acc": acc[max(acc)] if acc else math.nan,
        "peak_acc": max(series) if acc else math.nan,
        "collapsed": collapsed(series) if acc else None,
        "acc_256": acc.get(EARLY_UPDATE, math.nan),
        "clip_rise": _mean_over(run, "clip_frac", 0.75 * total, total) - _mean_over(run, "clip_frac", 0, total / 16),
        "veto_drop": stages[0] - float(np.mean(stages[1:])) if len(stages) > 1 else math.nan,
        "late_acc": float(np.mean([acc[u] for u in sorted(acc)[-LATE_POINTS:]])) if acc else math.nan,
    }
    out["stable"] = None if out["collapsed"] is None else not out["collapsed"]
    return out


MAIN_BMINI = 16
"""The B_mini of the design's main arms (phase 1, phase 2); the B_mini sweep's other sizes are arms ``...@B`` only."""


def arm_names(run: RunData, prefix: str = "") -> list[str]:
    """The claim arms a run stands for: ``<prefix><variant>@<B_mini>``, and ``<prefix><variant>`` at
    :data:`MAIN_BMINI` only (a sweep run at another B_mini must not stand in for the main arm's seed)."""
    b_mini = run.config["schedule"]["groups_per_update"]
    return [f"{prefix}{run.variant}"] * (b_mini == MAIN_BMINI) + [f"{prefix}{run.variant}@{b_mini}"]


def claim_values(entries: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, dict[int, Any]]]:
    """metric -> arm -> seed -> value from entries ``{"arms": [...], "seed": s, "figures": {...}}`` (the
    ``summary.json`` form); None and NaN figures are left out."""
    values: dict[str, dict[str, dict[int, Any]]] = {}
    for e in entries:
        for metric, v in e["figures"].items():
            if v is None or (isinstance(v, float) and not math.isfinite(v)):
                continue
            for arm in e["arms"]:
                values.setdefault(metric, {}).setdefault(arm, {})[int(e["seed"])] = v
    return values


def _test(c: Claim) -> str:
    if c.test == "count":
        return f"`{c.metric}`: {c.arm} in ≥ {c.at_least} seeds"
    if c.test == "mean":
        return f"`{c.metric}` of {c.arm} {'>' if c.direction > 0 else '<'} 0"
    if c.test == "noninferior":
        return f"`{c.metric}`: {c.arm} − {c.other}, lower end > −{NONINFERIORITY_MARGIN:g}"
    return f"`{c.metric}`: {c.arm} − {c.other} {'>' if c.direction > 0 else '<'} 0"


def _result(d: Decision) -> str:
    if d.count is not None:
        return f"{d.count[0]} of {d.count[1]} seeds"
    iv = d.interval
    return "-" if iv is None else f"{iv.mean:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}], n = {iv.n}"


def _has_figures(c: Claim, values: Mapping) -> bool:
    arms = values.get(c.metric, {})
    return bool(arms.get(c.arm)) and (c.other is None or bool(arms.get(c.other)))


def _finite(x: Any) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def _of_phase(arm: str, prefix: str) -> bool:
    """Whether ``arm`` is an arm of the folder with ``prefix`` (phase 1's "" excludes ``p2/...`` and the like)."""
    return arm.startswith(prefix) and "/" not in arm.removeprefix(prefix)


def bmini_table(entries: Iterable[Mapping[str, Any]], prefix: str = "") -> str:
    """Markdown: the paper's Table 3 side by side, one row per variant, one column per B_mini, each cell the final
    held-out accuracy's mean ± std over seeds (n) and the number of collapsed seeds; "" unless some variant has
    runs at two or more B_mini (each B_mini of the sweep is its own study folder, joined by ``--claims-with``).
    Only arms of ``prefix`` (phase 1's: none) count."""
    cells: dict[str, dict[int, list[Mapping[str, Any]]]] = {}
    for e in entries:
        for arm in e["arms"]:
            name, _, b = arm.rpartition("@")
            if name and _of_phase(name, prefix):
                cells.setdefault(name.removeprefix(prefix), {}).setdefault(int(b), []).append(e["figures"])
    sizes = sorted({b for by in cells.values() for b in by})
    if not any(len(by) > 1 for by in cells.values()):
        return ""
    body = []
    for variant, by in sorted(cells.items()):
        row = [variant]
        for b in sizes:
            figs = by.get(b, [])
            acc = [f["final_acc"] for f in figs if _finite(f.get("final_acc"))]
            if not acc:
                row.append("-")
                continue
            sd = float(np.std(acc, ddof=1)) if len(acc) > 1 else 0.0
            row.append(f"{np.mean(acc):.3f} ± {sd:.3f} (n = {len(acc)}; {sum(bool(f.get('collapsed')) for f in figs)} "
                       "collapsed)")  # fmt: skip
        body.append(row)
    header = ["variant", *(f"B_mini = {b}" for b in sizes)]
    return "## Final held-out accuracy by B_mini (the paper's Table 3)\n\n" + markdown_table(header, body) + "\n"


def claims_report(entries: Iterable[Mapping[str, Any]]) -> str:
    """Markdown: the claims with figures in ``entries`` (claim, test, mean per-seed difference with its 95 %
    interval or the count of seeds, verdict), then the ids of the claims without figures here."""
    values = claim_values(entries)
    decisions = decide_all(values)
    shown = [c for c in CLAIMS if _has_figures(c, values)]
    body = [[c.id, c.text, _test(c), _result(decisions[c.id]), decisions[c.id].label] for c in shown]
    parts = ["## Claims (rules set in advance: docs/STUDY.md)\n"]
    if body:
        parts.append(markdown_table(["id", "claim", "test", "per-seed difference, 95 % interval", "verdict"], body))
    missing = [c.id for c in CLAIMS if c not in shown]
    if missing:
        parts.append(f"\nNo figures here for: {', '.join(missing)}.")
    return "\n".join(parts) + "\n"


def late_table(entries: Iterable[Mapping[str, Any]], prefix: str = "") -> str:
    """Markdown, descriptive only: per main arm of ``prefix`` (B_mini 16), the mean over seeds of ``final_acc``,
    ``late_acc`` and ``peak_acc``, and the seeds whose ``late_acc`` lies at least the collapse margin under their
    peak ("late drop"), beside the rule's ``collapsed`` count; "" without accuracy figures."""
    arms: dict[str, list[Mapping[str, Any]]] = {}
    for e in entries:
        for arm in e["arms"]:
            if "@" not in arm and _of_phase(arm, prefix):
                arms.setdefault(arm, []).append(e["figures"])
    body = []
    for arm, figs in sorted(arms.items()):
        figs = [f for f in figs if _finite(f.get("late_acc")) and _finite(f.get("peak_acc"))]
        if not figs:
            continue
        n, drop = len(figs), sum(f["late_acc"] <= f["peak_acc"] - COLLAPSE_MARGIN for f in figs)
        means = [f"{np.mean([f[k] for f in figs]):.3f}" for k in ("final_acc", "late_acc", "peak_acc")]
        body.append([arm, *means, f"{drop} of {n}", f"{sum(bool(f.get('collapsed')) for f in figs)} of {n}"])
    if not body:
        return ""
    header = ["arm", "final", f"mean of last {LATE_POINTS}", "peak", "late drop (≥ 0.05 under peak)", "collapsed"]
    return ("## Descriptive: the last evaluations against the peak (chosen after seeing data; decides nothing)\n\n"
            + markdown_table(header, body) + "\n")  # fmt: skip


def _per_seed(c: Claim, values: Mapping, prefix: str) -> dict[int, Any]:
    """A phase-1 claim's per-seed value among the arms of ``prefix``: the difference (``paired``), the figure
    (``mean``) or the event (``count``); {} where an arm has no figures."""
    arms = values.get(c.metric, {})
    a = arms.get(prefix + c.arm, {})
    if c.test == "paired":
        b = arms.get(prefix + (c.other or ""), {})
        return {s: a[s] - b[s] for s in sorted(set(a) & set(b))}
    return dict(sorted(a.items())) if c.test in ("mean", "count") else {}


def consistency_report(entries: Iterable[Mapping[str, Any]], prefix: str) -> str:
    """Markdown without verdicts, for a folder whose arms (``prefix``, e.g. the second model's ``1m/``) no claim
    names: each phase-1 claim its arms allow, with its per-seed values and whether every seed points the claimed
    way (a ``count`` claim: every seed shows the event). "" where no claim applies."""
    values = claim_values(entries)
    body = []
    for c in CLAIMS:
        if "/" in c.arm or "@" in c.arm or not (seeds := _per_seed(c, values, prefix)):
            continue
        if c.test == "count":
            shown = ", ".join(f"seed {s}: {'yes' if v else 'no'}" for s, v in seeds.items())
            same = all(bool(v) for v in seeds.values())
        else:
            shown = ", ".join(f"seed {s}: {v:+.3f}" for s, v in seeds.items())
            same = all(c.direction * v > 0 for v in seeds.values())
        named = replace(c, arm=prefix + c.arm, other=c.other and prefix + c.other)
        body.append([c.id, c.text, _test(named), shown, "yes" if same else "no"])
    if not body:
        return ""
    title = (
        f"## The claims on the arms `{prefix}*` (no verdicts: each seed's value, and whether all point the claimed way)"
    )
    return f"{title}\n\n" + markdown_table(["id", "claim", "test", "per seed", "consistent"], body) + "\n"
