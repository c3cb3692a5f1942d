"""The staleness study: its variants, run status, per-run summaries, aggregation over seeds (tables: ``study_tables``).

Pure (no Ray, no subprocesses): :mod:`launch.study` runs ``launch.train`` once per (variant, seed)
into ``<out>/<variant>/seed-<s>/`` and hands the run folders to the functions here; the figures are
drawn by :mod:`launch.study_plot`.

A variant is a list of ``dotted.key=value`` overrides applied on top of the study's base config, and
no variant touches the task, the model, ``schedule.total_updates`` or ``schedule.groups_per_update``:
every variant has the same samples budget (total_updates x B_mini groups of G) and the same number of
optimizer updates; only the loss and the staleness mu change. The base config's ``schedule.mu`` is the
study's "high" staleness (the paper's mu = 1024 at 4096 updates: four stages).

Accuracy is read from the run's ``eval`` records (``eval/mean``: pass@1 on the held-out benchmarks,
written every ``eval.every_updates`` updates and at the end). A run without them falls back to the
stage records' ``reward_mean`` (the behaviour policy's sampled reward on its stage's fresh training
prompts); :func:`summarize_run` says which source it used.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml

from mugrpo_async.config import Config
from mugrpo_async.ratio_bins import hist_bin_centre


@dataclass(frozen=True)
class Variant:
    """One arm of the study.

    Attributes:
        name: Registry key and run-folder name, e.g. ``"mu_grpo"``.
        label: Legend / table label.
        overrides: ``dotted.key=value`` items applied after the base config.
    """

    name: str
    label: str
    overrides: tuple[str, ...]


def _v(name: str, label: str, *overrides: str) -> Variant:
    return Variant(name, label, overrides)


_RELAXED = "algo.name=grpo_relaxed"
_MU_GRPO = "algo.name=mu_grpo"
MU_SWEEP = (4, 8, 16, 64, 128)
CLIP_SWEEP = {"3": "3", "10": "10", "inf": ".inf"}  # name -> algo.clip_high
TAU_SWEEP = ("1e-1", "1e-2", "1e-3", "1e-5", "1e-6")

VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        _v("grpo_mu4", "GRPO mu=4 [0.8,1.2]", "algo.name=grpo", "schedule.mu=4"),
        _v("grpo", "GRPO high mu [0.8,1.2]", "algo.name=grpo"),
        _v("relaxed", "[0,5] no veto", _RELAXED),
        _v("veto_trigger", "[0,5] veto T", _RELAXED, "algo.nav_scope=trigger"),
        _v("veto_suffix_nontrigger", "[0,5] veto H_kappa", _RELAXED, "algo.nav_scope=suffix_nontrigger"),
        _v("veto_suffix", "[0,5] veto S_kappa", _RELAXED, "algo.nav_scope=suffix"),
        _v("mu_grpo", "mu-GRPO ([0,5] veto S_seq)", _MU_GRPO),
        _v("m2po", "M2PO high mu", "algo.name=m2po"),
        *(_v(f"mu_grpo_mu{m}", f"mu-GRPO mu={m}", _MU_GRPO, f"schedule.mu={m}") for m in MU_SWEEP),
        *(_v(f"mu_grpo_clip{c}", f"mu-GRPO [0,{c}]", _MU_GRPO, f"algo.clip_high={v}") for c, v in CLIP_SWEEP.items()),
        *(_v(f"mu_grpo_tau{t}", f"mu-GRPO tau={t}", _MU_GRPO, f"algo.nav_tau={t}") for t in TAU_SWEEP),
    )
}
"""Every variant by name; ``--variants`` takes these names and the group names of :data:`GROUPS`."""

SCOPE_VARIANTS = ("relaxed", "veto_trigger", "veto_suffix_nontrigger", "veto_suffix", "mu_grpo")
"""Relaxed bounds [0, 5] under each veto scope (none, T, H_kappa, S_kappa, S_seq): Figures 3 and 6."""

GROUPS: dict[str, tuple[str, ...]] = {
    "core": ("grpo_mu4", "grpo", *SCOPE_VARIANTS, "m2po"),
    "mu": (*(f"mu_grpo_mu{m}" for m in MU_SWEEP), "mu_grpo"),
    "clip": (*(f"mu_grpo_clip{c}" for c in CLIP_SWEEP), "mu_grpo"),
    "tau": (*(f"mu_grpo_tau{t}" for t in TAU_SWEEP), "mu_grpo"),
}
"""Named sets of variants: the paper's comparisons (core) and its sweeps (mu: Table 4, clip, tau)."""


def resolve_variants(spec: list[str]) -> list[Variant]:
    """Variants named by ``spec`` (variant or group names), in order, each once.

    Raises:
        KeyError: for an unknown name; the message lists the valid variants and groups.
    """
    out: dict[str, Variant] = {}
    for item in spec:
        names = GROUPS.get(item, (item,))
        for name in names:
            if name not in VARIANTS:
                raise KeyError(f"unknown variant {name!r}; valid: {', '.join(VARIANTS)}; groups: {', '.join(GROUPS)}")
            out.setdefault(name, VARIANTS[name])
    return list(out.values())


def read_run_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl`` (none if missing); a torn last line is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # only a run killed mid-write leaves one; the resumed run rewrites it
    return rows


def run_status(run_dir: str | Path, cfg: Config) -> Literal["new", "partial", "done", "mismatch"]:
    """Whether the run of ``cfg`` in ``run_dir`` is still to do.

    ``done``: an ``end`` record for ``cfg.schedule.total_updates`` updates; ``partial``: a started run
    (``launch.train`` resumes it); ``new``: no run there; ``mismatch``: the folder holds a run of
    another configuration (its ``config.yaml`` has another resume digest), which is never reused.
    """
    run_dir = Path(run_dir)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return "new"
    from mugrpo_async.config import build_config

    if build_config(yaml.safe_load(saved.read_text())).resume_digest() != cfg.resume_digest():
        return "mismatch"
    ends = [r for r in read_run_records(run_dir) if r.get("kind") == "end"]
    return "done" if ends and ends[-1].get("updates") == cfg.schedule.total_updates else "partial"


@dataclass
class RunData:
    """One finished (or partial) run folder, read once.

    Attributes:
        variant: Variant name.
        seed: ``run.seed``.
        config: The resolved config (``config.yaml``) as a nested dict.
        updates / stages / evals: Records of that kind, one per update / stage / evaluated update
            (the newest record wins where a resumed run wrote one twice).
        end: The ``end`` record, or None for an unfinished run.
        initial: Held-out accuracy of the policy before training (:func:`initial_accuracy`), if measured.
    """

    variant: str
    seed: int
    config: dict[str, Any]
    updates: list[dict[str, Any]] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    initial: float | None = None


def _newest_by(records: list[dict], kind: str, key: str) -> list[dict]:
    by = {r[key]: r for r in records if r.get("kind") == kind and key in r}
    return [by[k] for k in sorted(by)]


def load_run(run_dir: str | Path, variant: str, seed: int, initial: float | None = None) -> RunData:
    """Read a run folder (``config.yaml`` and ``metrics.jsonl``) into :class:`RunData`."""
    run_dir = Path(run_dir)
    rows = read_run_records(run_dir)
    ends = [r for r in rows if r.get("kind") == "end"]
    return RunData(
        variant=variant, seed=seed, config=yaml.safe_load((run_dir / "config.yaml").read_text()),
        updates=_newest_by(rows, "update", "update"), stages=_newest_by(rows, "stage", "stage"),
        evals=_newest_by(rows, "eval", "update"), end=ends[-1] if ends else None, initial=initial,
    )  # fmt: skip


def initial_accuracy(path: str | Path) -> float | None:
    """Mean pass@1 over the benchmarks of a ``launch.eval --out`` file (None if missing or empty)."""
    path = Path(path)
    scores = [b["pass@1"] for b in json.loads(path.read_text())["benchmarks"].values()] if path.is_file() else []
    scores = [x for x in scores if x is not None]
    return sum(scores) / len(scores) if scores else None


def accuracy_points(run: RunData, key: str = "eval/mean", with_initial: bool = False):
    """``(source, [(update, t_wall_s, accuracy), ...])`` of a run, in update order.

    source ``eval``: the eval records' ``key``, led by ``(0, 0.0, run.initial)`` when ``with_initial``
    and measured; ``train_reward`` (no eval records): each stage's rollout reward, placed at the
    stage's policy version and at the wall-clock time its first update was logged (rollouts done).
    """
    pts = [(r["update"], r["t_wall_s"], r[key]) for r in run.evals if r.get(key) is not None]
    if pts:
        return "eval", ([(0, 0.0, run.initial)] if with_initial and run.initial is not None else []) + pts
    first = {}
    for r in run.updates:
        first.setdefault(r["policy_version"], r["t_wall_s"])
    pts = [(s["policy_version"], first.get(s["policy_version"], math.nan), s["reward_mean"]) for s in run.stages]
    return "train_reward", pts


def _stage_updates(run: RunData) -> list[list[dict[str, Any]]]:
    """The update records of each stage (grouped by policy version), in order."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in run.updates:
        by.setdefault(r["policy_version"], []).append(r)
    return [by[v] for v in sorted(by)]


def per_stage(run: RunData, key: str) -> list[float]:
    """Mean of update metric ``key`` over each stage (updates grouped by policy version, in order)."""
    return [float(np.mean([r.get(key, math.nan) for r in rs])) for rs in _stage_updates(run)]


def per_stage_tokens(run: RunData, num: str = "num_vetoed", den: str = "num_tokens") -> list[float]:
    """Sum of ``num`` over sum of ``den`` in each stage, e.g. the veto's token-weighted share (Appendix C.1's
    form); NaN for a stage whose records lack the counts (written before they were recorded)."""
    sums = [(math.fsum(r.get(num, math.nan) for r in rs), math.fsum(r.get(den, math.nan) for r in rs))
            for rs in _stage_updates(run)]  # fmt: skip
    return [n / d if d > 0 else math.nan for n, d in sums]


def summarize_run(run: RunData, key: str = "eval/mean") -> dict[str, Any]:
    """The table figures of one run.

    Returns:
        ``best_acc`` / ``final_acc`` (max / last of :func:`accuracy_points`), ``acc_source``,
        ``T_rollout`` / ``T_total`` (the end record; NaN while unfinished), ``clip_frac`` /
        ``veto_frac`` / ``trigger_seq_frac`` (means over updates), ``veto_per_stage`` (list, the mean over a
        stage's updates), ``veto_per_stage_tokens`` (vetoed over response tokens per stage), and the
        run's settings ``mu``, ``clip``, ``scope``, ``tau``.
    """
    source, pts = accuracy_points(run, key)
    acc = [a for _, _, a in pts]
    end = run.end or {}
    algo, sched = run.config["algo"], run.config["schedule"]
    ups = run.updates
    return {
        "variant": run.variant, "seed": run.seed, "acc_source": source,
        "best_acc": max(acc) if acc else math.nan, "final_acc": acc[-1] if acc else math.nan,
        "T_rollout": end.get("T_rollout", math.nan), "T_total": end.get("T_total", math.nan),
        "clip_frac": mean_std([r["clip_frac"] for r in ups])[0],
        "veto_frac": mean_std([r["nav_veto_frac"] for r in ups])[0],
        "trigger_seq_frac": mean_std([r.get("nav_trigger_seq_frac", math.nan) for r in ups])[0],
        "veto_per_stage": per_stage(run, "nav_veto_frac"), "veto_per_stage_tokens": per_stage_tokens(run),
        "updates": len(ups),
        "mu": sched["mu"], "clip": (algo["clip_low"], algo["clip_high"]), "scope": algo["nav_scope"],
        "tau": algo["nav_tau"], "algo": algo["name"],
    }  # fmt: skip


def mean_std(values: list[float]) -> tuple[float, float, int]:
    """(mean, sample std, count) over the finite values; std is 0.0 for one value, NaN for none."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if not len(x):
        return math.nan, math.nan, 0
    return float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else 0.0, len(x)


STAT_KEYS = ("best_acc", "final_acc", "T_rollout", "T_total", "clip_frac", "veto_frac", "trigger_seq_frac")


def aggregate_variants(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant (first-seen order) from the per-run summaries of all seeds.

    Each row holds the variant's settings, ``seeds`` (list), ``acc_source`` (``eval`` only when every
    seed had eval records), ``(mean, std, n)`` for every :data:`STAT_KEYS` key, and
    ``veto_per_stage`` as the per-stage mean over seeds.
    """
    rows: dict[str, list[dict[str, Any]]] = {}
    for s in summaries:
        rows.setdefault(s["variant"], []).append(s)
    out = []
    for name, runs in rows.items():
        first = runs[0]
        row = {k: first[k] for k in ("variant", "mu", "clip", "scope", "tau", "algo")}
        row["label"] = VARIANTS[name].label if name in VARIANTS else name
        row["seeds"] = [r["seed"] for r in runs]
        row["acc_source"] = "eval" if all(r["acc_source"] == "eval" for r in runs) else "train_reward"
        row |= {k: mean_std([r[k] for r in runs]) for k in STAT_KEYS}
        n_stages = min(len(r["veto_per_stage"]) for r in runs)
        row["veto_per_stage"] = [float(np.mean([r["veto_per_stage"][i] for r in runs])) for i in range(n_stages)]
        out.append(row)
    return out


def update_series(run: RunData, key: str, zero_is_missing: bool = False) -> list[tuple[int, float, float]]:
    """``[(update, t_wall_s, value)]`` of update metric ``key``.

    ``zero_is_missing``: an exact 0.0 becomes NaN. ``ratio_mean_neg_adv`` needs it: a ratio is always
    positive, and the metric is 0.0 only for a minibatch without negative-advantage tokens.
    """
    ys = [r.get(key, math.nan) for r in run.updates]
    return [
        (r["update"], r["t_wall_s"], math.nan if zero_is_missing and y == 0.0 else y) for r, y in zip(run.updates, ys)
    ]


def seed_curve(series: list[list[tuple[int, float, float]]]) -> dict[str, np.ndarray]:
    """Mean over seeds of per-run ``[(x, t, y)]`` series, on the x values that every run has.

    Returns:
        ``{"x", "t", "y", "y_std"}``, each (P,) for the P common x values: t is the mean wall-clock time
        at x, y the NaN-ignoring mean, y_std the sample std over seeds (0 with one seed; NaN where fewer
        than one value is finite).
    """
    if not series:
        return {k: np.zeros(0) for k in ("x", "t", "y", "y_std")}
    common = sorted(set.intersection(*({x for x, _, _ in s} for s in series)))
    t = np.full((len(series), len(common)), np.nan)
    y = np.full_like(t, np.nan)
    for i, s in enumerate(series):
        by = {x: (tt, yy) for x, tt, yy in s}
        for j, x in enumerate(common):
            t[i, j], y[i, j] = by[x]
    finite = np.isfinite(y).sum(axis=0)  # (P,)
    with warnings.catch_warnings():  # all-NaN columns: NaN is the answer there
        warnings.simplefilter("ignore", RuntimeWarning)
        y_mean, y_std = np.nanmean(y, axis=0), np.where(finite == 1, 0.0, np.nanstd(y, axis=0, ddof=1))
    return {"x": np.asarray(common, dtype=float), "t": np.nanmean(t, axis=0) if len(common) else np.zeros(0),
            "y": y_mean, "y_std": y_std}  # fmt: skip


def running_mean(y: np.ndarray, k: int) -> np.ndarray:
    """Centred running mean over ``k`` points that skips NaN (NaN where a window holds none); same length."""
    y = np.asarray(y, dtype=float)
    k = max(1, min(int(k), len(y)))
    ok = np.isfinite(y)
    kernel = np.ones(k)
    sums = np.convolve(np.where(ok, y, 0.0), kernel, mode="same")
    counts = np.convolve(ok.astype(float), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def ratio_histogram(runs: list[RunData], first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
    """The negative-advantage tokens' log10-ratio histogram over updates ``first..last``, pooled over ``runs``:
    (log10 rho at each non-empty bin's centre, that bin's share of the tokens), in bin order; empty arrays where
    the records carry no histogram."""
    counts: dict[int, float] = {}
    for run in runs:
        for r in run.updates:
            if first <= r["update"] <= last:
                for k, c in r.get("hist_log_ratio_neg_adv", {}).items():
                    counts[int(k)] = counts.get(int(k), 0.0) + float(c)
    total = sum(counts.values())
    if total <= 0:
        return np.zeros(0), np.zeros(0)
    bins = sorted(counts)
    return np.array([hist_bin_centre(k) for k in bins]), np.array([counts[k] / total for k in bins])
