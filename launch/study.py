"""Run the staleness study: every (variant, seed) through ``launch.train``, then its tables and figures.

    python -m launch.study --config configs/study/tiny.yaml --variants core,mu_grpo_mu4,mu_grpo_mu128 \\
        --seeds 0,1 --out runs/study --plots docs/study [--dry-run | --report-only] [dotted.key=value ...]

Variants and groups: see :mod:`mugrpo_async.reporting.study` (``core``: GRPO mu=4, GRPO / relaxed / each veto scope /
M2PO at the config's mu; ``mu``, ``clip``, ``tau``: the sweeps). Overrides apply to every run (a variant's
own overrides win). Each run is ``python -m launch.train`` into ``<out>/<variant>/seed-<s>/`` with its
log beside it (``seed-<s>.log``); runs go one at a time, seed by seed over all variants, so that load on
the machine drifts over every variant alike. Before a seed's runs, ``launch.eval`` scores the untrained
policy on the same held-out set (``<out>/initial/seed-<s>.json``, once; ``--skip-initial`` leaves it out).
A finished run (an ``end`` record) is skipped, a started one is resumed, and a folder holding a run of
another configuration stops the study before anything starts. Then ``<out>/study.md`` (tables),
``<out>/summary.json`` (per-run figures) and the figures (``--plots``, default ``<out>/plots``) are written.
Exit code 2: bad variant, seed or config; 1: some run failed (the others still ran and are reported).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

from mugrpo_async.config import ConfigError, load_config
from mugrpo_async.reporting.study import (
    aggregate_variants,
    initial_accuracy,
    load_run,
    resolve_variants,
    run_status,
    study_report,
    summarize_run,
)

log = logging.getLogger("launch.study")
FIXED = ["run.dashboard=false", "logging.progress=false"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.study", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="base config: task, model, budget, the high mu")
    p.add_argument("--variants", default="core", help="comma-separated variant and group names (default: core)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated run.seed values (default: 0,1,2)")
    p.add_argument("--out", type=Path, default=Path("runs/study"), help="study folder (default: runs/study)")
    p.add_argument("--plots", type=Path, help="folder for the figures (default: <out>/plots)")
    p.add_argument("--dry-run", action="store_true", help="validate and list the runs with their status; run nothing")
    p.add_argument("--report-only", action="store_true", help="only tables and figures from the finished runs")
    p.add_argument("--skip-initial", action="store_true", help="do not evaluate the untrained policy")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every run")
    return p


def plan(args: argparse.Namespace) -> list[dict]:
    """Every (variant, seed) with its train overrides, resolved config and status; seed-major order.

    Raises:
        KeyError / ValueError / ConfigError: a bad name, seed or config (the message names the variant),
            variants with different samples budgets, or a run folder of another configuration.
    """
    variants = resolve_variants([v for v in args.variants.split(",") if v.strip()])
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    runs, budgets = [], {}
    for seed in seeds:
        for v in variants:
            path = args.out / v.name / f"seed-{seed}"
            ov = [*args.overrides, *v.overrides, f"run.seed={seed}", f"run.output_dir={path}",
                  f"run.name=study-{v.name}-s{seed}", *FIXED]  # fmt: skip
            try:
                cfg = load_config(args.config, ov)
            except ConfigError as err:
                raise ConfigError(f"variant {v.name}: {err}") from None
            budgets[v.name] = (cfg.schedule.total_updates, cfg.schedule.groups_per_update, cfg.rollout.group_size)
            status = run_status(path, cfg)
            if status == "mismatch":
                raise ConfigError(f"{path} holds a run of another configuration: remove it or choose another --out")
            runs.append({"variant": v.name, "seed": seed, "path": path, "overrides": ov, "status": status})
    if len(set(budgets.values())) > 1:
        raise ConfigError(f"variants differ in samples budget (updates, B_mini, G): {budgets}")
    return runs


def train(config: str, run: dict) -> int:
    """One ``launch.train`` run, its output in ``<variant>/seed-<s>.log``; returns its exit code."""
    logfile = run["path"].parent / f"{run['path'].name}.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "launch.train", "--config", config, *run["overrides"]]
    with logfile.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode


def initial_eval(args: argparse.Namespace, seed: int) -> None:
    """The untrained policy on the held-out benchmarks for ``seed`` (``launch.eval``, once per study folder)."""
    path = args.out / "initial" / f"seed-{seed}.json"
    if path.is_file() or not load_config(args.config, args.overrides).eval.benchmarks:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "launch.eval", "--config", args.config, "--out", str(path), *args.overrides,
           f"run.seed={seed}", *FIXED]  # fmt: skip
    with (path.parent / f"seed-{seed}.log").open("a") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    log.info("initial policy, seed %d: exit %d", seed, rc)


def report(args: argparse.Namespace, runs: list[dict]) -> list[Path]:
    """Tables (``study.md``), per-run figures (``summary.json``) and the figures from the finished runs."""
    from launch.study_plot import plot_study

    done = [r for r in runs if run_status(r["path"], load_config(args.config, r["overrides"])) == "done"]
    initial = {s: initial_accuracy(args.out / "initial" / f"seed-{s}.json") for s in {r["seed"] for r in runs}}
    data = {}
    for r in done:
        data.setdefault(r["variant"], []).append(load_run(r["path"], r["variant"], r["seed"], initial[r["seed"]]))
    summaries = [summarize_run(d) for ds in data.values() for d in ds]
    measured = [a for _, a in sorted(initial.items()) if a is not None]
    text = study_report(aggregate_variants(summaries), measured) if summaries else "no finished runs\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "study.md").write_text(text)
    (args.out / "summary.json").write_text(json.dumps(summaries, indent=1))
    print(text)
    return [args.out / "study.md", *plot_study(data, args.plots or args.out / "plots")] if data else []


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        runs = plan(args)
    except (KeyError, ValueError) as err:  # ConfigError is a ValueError
        print(f"error: {err.args[0] if err.args else err}", file=sys.stderr)
        return 2
    for r in runs:
        print(f"{r['status']:>8}  {r['path']}")
    if args.dry_run:
        return 0
    failed, t0 = [], time.perf_counter()
    for i, r in enumerate(runs if not args.report_only else []):
        if not args.skip_initial and (i == 0 or r["seed"] != runs[i - 1]["seed"]):
            initial_eval(args, r["seed"])
        if r["status"] == "done":
            continue
        t1 = time.perf_counter()
        rc = train(args.config, r)
        log.info("run %d/%d %s seed %d: exit %d, %.0fs", i + 1, len(runs), r["variant"], r["seed"], rc,
                 time.perf_counter() - t1)  # fmt: skip
        if rc:
            failed.append(f"{r['path']} (exit {rc}, log {r['path'].parent / r['path'].name}.log)")
    for p in report(args, runs):
        print(p)
    print(f"study wall time {time.perf_counter() - t0:.0f}s")
    if failed:
        print("failed runs:\n  " + "\n  ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
