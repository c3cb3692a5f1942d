"""Draw a run's plots (PNG, matplotlib) from its metrics.jsonl.

    python -m launch.plot runs/tiny-cpu [--out runs/tiny-cpu/plots]

- ``reward_vs_time.png``: minibatch reward (and its running mean) against wall-clock time, the
  paper's Figure 1 form; stage rewards as markers in sync runs;
- ``idle_and_lag.png``: trainer idle ratio and lag (mean, max) over updates;
- ``veto_per_stage.png``: NAV veto fraction and clip fraction per stage (sync) or per policy version
  (async).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from mugrpo_async.reporting.metrics import read_metrics  # noqa: E402


def _running_mean(x: list[float], k: int) -> np.ndarray:
    k = max(1, min(k, len(x)))
    return np.convolve(x, np.ones(k) / k, mode="valid")


def plot_run(run_dir: Path, out: Path) -> list[Path]:
    """Write the three PNGs into ``out``; returns their paths."""
    ups = read_metrics(run_dir, "update")
    stages = read_metrics(run_dir, "stage")
    if not ups:
        raise ValueError(f"{run_dir}/metrics.jsonl has no update records")
    out.mkdir(parents=True, exist_ok=True)
    t = [r.get("t_wall_s", i) for i, r in enumerate(ups)]
    reward = [r["reward_mean"] for r in ups]
    k = max(1, len(ups) // 16)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(t, reward, ".", alpha=0.3, label="minibatch reward")
    ax.plot(t[k - 1 :], _running_mean(reward, k), label=f"running mean ({k} updates)")
    if stages:
        ax.plot([s["t_wall_s"] for s in stages], [s["reward_mean"] for s in stages], "s-", label="stage rollouts")
    ax.set(xlabel="wall-clock time (s)", ylabel="reward (accuracy)", title=run_dir.name)
    ax.legend()
    paths = [_save(fig, out / "reward_vs_time.png")]

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    x = [r["update"] for r in ups]
    a1.plot(x, [r["trainer_idle_ratio"] for r in ups])
    a1.set(ylabel="trainer idle ratio", ylim=(0, 1))
    a2.plot(x, [r["lag_mean"] for r in ups], label="lag mean")
    a2.plot(x, [r["lag_max"] for r in ups], label="lag max")
    a2.set(xlabel="update", ylabel="lag (updates)")
    a2.legend()
    paths.append(_save(fig, out / "idle_and_lag.png"))

    by = defaultdict(list)
    for r in ups:
        by[r["policy_version"]].append(r)
    keys = sorted(by)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(len(keys)), [np.mean([r["nav_veto_frac"] for r in by[v]]) for v in keys], "o-", label="veto frac")
    ax.plot(range(len(keys)), [np.mean([r["clip_frac"] for r in by[v]]) for v in keys], "s-", label="clip frac")
    ax.set(xlabel="stage" if stages else "policy version index", ylabel="fraction of response tokens")
    ax.legend()
    paths.append(_save(fig, out / "veto_per_stage.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.plot", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, help="folder for the PNGs (default: <run_dir>/plots)")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.run_dir, args.out or args.run_dir / "plots")
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
