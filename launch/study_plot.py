"""The staleness study's figures (PNG, matplotlib), drawn from run folders read by :mod:`mugrpo_async.reporting.study`.

- ``accuracy_vs_time.png``: held-out accuracy against wall-clock time (the paper's Figure 1 form);
- ``accuracy_clip_over_updates.png``: accuracy and clip fraction over updates (Figure 2 form);
- ``accuracy_by_scope.png``: accuracy over updates per veto scope;
- ``ratio_neg_adv_by_scope.png``: E[rho | A < 0] over updates per veto scope (Figure 3 form);
- ``veto_frac_over_updates.png``: veto fraction over updates per veto scope (Figure 6 form);
- ``mu_sweep.png``: accuracy against wall-clock time per mu (the mu sweep, when it ran);
- ``accuracy_per_seed.png``: every run's accuracy over updates, one panel per variant, one line per seed (the mean
  hides a collapse that only some seeds have);
- ``ratio_tail_by_scope.png``: P(rho < 0.1 | A < 0) over updates per veto scope (the tail the veto acts on);
- ``ratio_hist_by_scope.png``: the negative-advantage tokens' log10 rho histogram in the first, middle and last
  eighth of the updates, one panel per veto scope, pooled over seeds.

Every curve but the per-seed panels is the mean over seeds (shaded: +- one std); per-update metrics are smoothed
over ``smooth`` updates (by default a 64th of the run, at least 4); accuracy curves start at the untrained policy
when it was evaluated. Figures 1 and 2 show :data:`HEADLINE` (the veto scopes have figures of their own). A figure
whose variants did not run is left out.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from mugrpo_async.reporting.study import (  # noqa: E402
    GROUPS,
    SCOPE_VARIANTS,
    VARIANTS,
    RunData,
    accuracy_points,
    ratio_histogram,
    running_mean,
    seed_curve,
    update_series,
)

Runs = dict[str, list[RunData]]  # variant -> its runs (one per seed)
HEADLINE = ("grpo_mu4", "grpo", "relaxed", "mu_grpo", "m2po")
"""The variants of Figures 1 and 2: GRPO at low and high mu, relaxed bounds with and without the veto, M2PO."""


# One colour per core variant in every figure (the veto scopes from red, no veto, to green, S_seq).
COLORS = {"grpo_mu4": "black", "grpo": "0.55", "relaxed": "tab:red", "veto_trigger": "tab:orange",
          "veto_suffix_nontrigger": "tab:purple", "veto_suffix": "tab:blue", "mu_grpo": "tab:green",
          "m2po": "tab:brown"}  # fmt: skip
DASHED = {"veto_trigger", "veto_suffix"}  # often on top of no veto / H_kappa: drawn dashed so both show


def _label(name: str) -> str:
    return VARIANTS[name].label if name in VARIANTS else name


def _band(ax, x, c, label: str, smooth: int = 1, marker: str | None = None, color=None, name: str = "") -> None:
    y, s = running_mean(c["y"], smooth), running_mean(c["y_std"], smooth)
    ls = "--" if name in DASHED else "-"
    (line,) = ax.plot(x, y, marker=marker, ms=3, lw=1.3, ls=ls, label=label, color=color)
    ax.fill_between(x, y - s, y + s, color=line.get_color(), alpha=0.15, lw=0)


def _acc_curve(runs: list[RunData], key: str) -> tuple[dict, str]:
    pts = [accuracy_points(r, key, with_initial=True) for r in runs]
    source = "eval" if all(p[0] == "eval" for p in pts) else "train_reward"
    return seed_curve([p[1] for p in pts]), source


def _acc_label(source: str) -> str:
    return "held-out accuracy (pass@1)" if source == "eval" else "training reward (stage rollouts)"


def accuracy_vs_time(runs: Runs, names: list[str], path: Path, key: str, title: str, mu_labels=False, x="t"):
    """Accuracy against wall-clock time (``x="t"``, Figure 1 form) or updates (``x="x"``), one curve per
    variant; ``mu_labels``: label and colour the curves by mu."""
    names = [n for n in names if runs.get(n)]
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4))
    source = "eval"
    for n in names:
        c, src = _acc_curve(runs[n], key)
        source = source if src == "eval" else src
        label = f"mu = {runs[n][0].config['schedule']['mu']}" if mu_labels else _label(n)
        shade = 0.8 * names.index(n) / max(len(names) - 1, 1)  # viridis without its faint yellow end
        color = plt.get_cmap("viridis")(shade) if mu_labels else COLORS.get(n)
        _band(ax, c[x], c, label, marker="o", color=color, name=n)
    ax.set(xlabel="wall-clock time (s)" if x == "t" else "update", ylabel=_acc_label(source), title=title)
    ax.legend(fontsize=7)
    return _save(fig, path)


def accuracy_clip_over_updates(runs: Runs, names: list[str], path: Path, key: str, smooth: int) -> Path | None:
    """Accuracy (top) and clip fraction (bottom) over updates (Figure 2 form)."""
    names = [n for n in names if runs.get(n)]
    if not names:
        return None
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(6.4, 6), sharex=True)
    source = "eval"
    for n in names:
        c, src = _acc_curve(runs[n], key)
        source = source if src == "eval" else src
        _band(a1, c["x"], c, _label(n), marker="o", color=COLORS.get(n), name=n)
        clip = seed_curve([update_series(r, "clip_frac") for r in runs[n]])
        _band(a2, clip["x"], clip, _label(n), smooth, color=COLORS.get(n), name=n)
    a1.set(ylabel=_acc_label(source), title="accuracy and clip fraction over updates")
    a2.set(xlabel="update", ylabel=f"clip fraction (smoothed, {smooth} updates)")
    a1.legend(fontsize=7)
    return _save(fig, path)


def _has(runs: Runs, name: str, metric: str) -> bool:
    """Whether some update record of variant ``name`` carries ``metric``."""
    return any(metric in u for r in runs.get(name, []) for u in r.updates)


def per_scope(runs: Runs, metric: str, path: Path, ylabel: str, smooth: int) -> Path | None:
    """Update metric ``metric`` over updates for each veto scope that ran (Figures 3 and 6)."""
    names = [n for n in SCOPE_VARIANTS if _has(runs, n, metric)]
    if metric == "nav_veto_frac":
        names = [n for n in names if n != "relaxed"]  # no veto: identically 0
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for n in names:
        c = seed_curve([update_series(r, metric, zero_is_missing=metric == "ratio_mean_neg_adv") for r in runs[n]])
        _band(ax, c["x"], c, _label(n), smooth, color=COLORS.get(n), name=n)
    stage = runs[names[0]][0].config["schedule"]["mu"]
    for x in np.arange(stage, max(len(r.updates) for r in runs[names[0]]), stage):
        ax.axvline(x, color="0.85", lw=0.8, zorder=0)  # stage boundaries: the ratios restart at 1
    ax.set(xlabel="update", ylabel=f"{ylabel} (smoothed, {smooth} updates)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def accuracy_per_seed(runs: Runs, names: list[str], path: Path, key: str) -> Path | None:
    """One panel per variant: each seed's accuracy over updates (the untrained point first, when measured)."""
    names = [n for n in names if runs.get(n)]
    if not names:
        return None
    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), sharex=True, sharey=True, squeeze=False)
    for ax, n in zip(axes.flat, names):
        for r in sorted(runs[n], key=lambda r: r.seed):
            _, pts = accuracy_points(r, key, with_initial=True)
            ax.plot([u for u, _, _ in pts], [a for _, _, a in pts], lw=1, marker=".", ms=3, label=f"seed {r.seed}")
        ax.set_title(_label(n), fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=6)
    for ax in axes[-1]:
        ax.set_xlabel("update")
    for ax in axes[:, 0]:
        ax.set_ylabel("held-out accuracy", fontsize=8)
    return _save(fig, path)


def ratio_hist_by_scope(runs: Runs, path: Path) -> Path | None:
    """Per veto scope, the log10-rho histogram of negative-advantage tokens in three eighths of the run."""
    names = [n for n in SCOPE_VARIANTS if _has(runs, n, "hist_log_ratio_neg_adv")]
    if not names:
        return None
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3), sharey=True, squeeze=False)
    total = max(len(r.updates) for r in runs[names[0]])
    eighth = max(1, total // 8)
    blocks = [(1, eighth), ((total - eighth) // 2 + 1, (total + eighth) // 2), (total - eighth + 1, total)]
    for ax, n in zip(axes[0], names):
        for (a, b), shade in zip(blocks, (0.75, 0.45, 0.0)):
            x, share = ratio_histogram(runs[n], a, b)
            ax.step(x, share, where="mid", lw=1, color=str(shade), label=f"updates {a}-{b}")
        ax.axvline(-4, color="tab:red", lw=0.8, ls=":")  # tau = 1e-4
        ax.set(yscale="log", xlabel="log10 rho (A < 0 tokens)", title=_label(n))
        ax.title.set_fontsize(8)
    axes[0, 0].set_ylabel("share of tokens")
    axes[0, 0].legend(fontsize=6)
    return _save(fig, path)


def plot_study(runs: Runs, out: Path, key: str = "eval/mean", smooth: int | None = None) -> list[Path]:
    """Write every figure whose variants ran into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    longest = max((len(r.updates) for rs in runs.values() for r in rs), default=0)
    smooth = smooth or max(4, longest // 64)
    head = [n for n in HEADLINE if n in runs]
    scopes = [n for n in SCOPE_VARIANTS if n in runs]
    mu = sorted((n for n in GROUPS["mu"] if n in runs), key=lambda n: runs[n][0].config["schedule"]["mu"])
    tail = "P(rho < 0.1 | A<0)"
    paths = [
        accuracy_vs_time(runs, head, out / "accuracy_vs_time.png", key, "accuracy vs wall-clock"),
        accuracy_clip_over_updates(runs, head, out / "accuracy_clip_over_updates.png", key, smooth),
        accuracy_vs_time(runs, scopes, out / "accuracy_by_scope.png", key, "accuracy per veto scope", x="x"),
        per_scope(runs, "ratio_mean_neg_adv", out / "ratio_neg_adv_by_scope.png", "E[rho | A<0]", smooth),
        per_scope(runs, "ratio_below_0p1_neg_adv_frac", out / "ratio_tail_by_scope.png", tail, smooth),
        per_scope(runs, "nav_veto_frac", out / "veto_frac_over_updates.png", "veto fraction of tokens", smooth),
        ratio_hist_by_scope(runs, out / "ratio_hist_by_scope.png"),
        accuracy_per_seed(runs, [n for n in VARIANTS if n in runs], out / "accuracy_per_seed.png", key),
    ]
    if len(mu) >= 2:
        title = "mu-GRPO: accuracy vs wall-clock per mu"
        paths.append(accuracy_vs_time(runs, mu, out / "mu_sweep.png", key, title, mu_labels=True))
    return [p for p in paths if p is not None]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
