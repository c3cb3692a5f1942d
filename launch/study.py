"""Run the staleness study: every (variant, seed) through ``launch.train``, then its tables and figures.

    python -m launch.study --config configs/study/tiny.yaml --variants core,mu_grpo_mu4,mu_grpo_mu128 \\
        --seeds 0,1 --out runs/study --plots docs/study [--dry-run | --report-only] [dotted.key=value ...]
    python -m launch.study ... --variants grpo,relaxed,mu_grpo --replay-from grpo rollout.seeded_sampling=true

Variants and groups: see :mod:`mugrpo_async.reporting.study` (``core``: GRPO mu=4, GRPO / relaxed / each veto scope /
M2PO at the config's mu; ``mu``, ``clip``, ``tau``: the sweeps). Overrides apply to every run (a variant's
own overrides win). Each run is ``python -m launch.train`` into ``<out>/<variant>/seed-<s>/`` with its
log beside it (``seed-<s>.log``); runs go one at a time, seed by seed over all variants, so that load on
the machine drifts over every variant alike. Before a seed's runs, ``launch.eval`` scores the untrained
policy on the same held-out set (``<out>/initial/seed-<s>.json``, once; ``--skip-initial`` leaves it out), which
records the digest of the weights it scored; a seed whose configured model has other weights starts none of its
runs (:mod:`mugrpo_async.reporting.provenance`: a model built in code can differ on another CPU).
A finished run (an ``end`` record) is skipped, a started one is resumed, and a folder holding a run of
another configuration stops the study before anything starts. ``--replay-from SOURCE`` trains every variant of a
seed on one fixed rollout set: SOURCE's run of that seed generates it (a variant of this study runs first in each
seed; ``<study folder>/<variant>`` reads another study's finished runs), the others replay its stored stages
(:mod:`mugrpo_async.reporting.study_plan`); a replay whose source has not finished is not started. Then
``<out>/study.md`` (tables), ``<out>/summary.json`` (per-run figures) and the figures (``--plots``, default
``<out>/plots``) are written; ``study.md`` holds the per-level accuracy and format rate at the last evaluation
(:mod:`mugrpo_async.reporting.levels`) and ends with the claims table (:mod:`mugrpo_async.reporting.claims`):
this folder's runs count as the arms ``<--arms-prefix><variant>`` and ``...@<B_mini>``, and ``--claims-with``
adds other study folders' figures (phase 1 with its B_mini sweep and phase 2 in one table). A prefix that no claim
names (the second model's ``1m/``) gets each phase-1 claim's per-seed values and signs instead, without verdicts.
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

from mugrpo_async.checkpoints.model_folder import weights_digest
from mugrpo_async.config import load_config
from mugrpo_async.reporting.claims import (
    arm_names,
    bmini_table,
    claims_report,
    consistency_report,
    late_table,
    seed_figures,
)
from mugrpo_async.reporting.levels import levels_table
from mugrpo_async.reporting.provenance import model_change, stage_mismatches
from mugrpo_async.reporting.study import (
    aggregate_variants,
    initial_accuracy,
    load_run,
    resolve_variants,
    run_status,
    summarize_run,
)
from mugrpo_async.reporting.study_plan import FIXED, PlannedRun, replay_blocker, study_plan
from mugrpo_async.reporting.study_tables import study_report
from mugrpo_async.reporting.verdicts import CLAIMS

log = logging.getLogger("launch.study")


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
    p.add_argument("--replay-from", metavar="SOURCE",
                   help="a fixed rollout set per seed: SOURCE (a variant of this study, run first in each seed, or "
                   "<study folder>/<variant> of another study) generates the stages, every other variant replays "
                   "them (rollout.replay_dir)")  # fmt: skip
    p.add_argument(
        "--arms-prefix",
        default="",
        help="claim arms of this folder's runs: '' for phase 1 (default), 'p2/' for phase 2; another prefix "
        "(the second model's '1m/') reports the phase-1 claims per seed, without verdicts",
    )
    p.add_argument(
        "--claims-with",
        default="",
        help="comma-separated other study folders whose summary.json figures join the claims table",
    )
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every run")
    return p


def plan(args: argparse.Namespace) -> list[PlannedRun]:
    """Every (variant, seed) with its train overrides and status (:func:`mugrpo_async.reporting.study_plan.study_plan`).

    Raises:
        KeyError / ValueError / ConfigError: a bad name, seed or config, or a run folder of another configuration.
    """
    variants = resolve_variants([v for v in args.variants.split(",") if v.strip()])
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    return study_plan(args.config, variants, seeds, args.out, args.overrides, args.replay_from)


def train(config: str, run: PlannedRun) -> int:
    """One ``launch.train`` run, its output in ``<variant>/seed-<s>.log``; returns its exit code."""
    logfile = run.path.parent / f"{run.path.name}.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "launch.train", "--config", config, *run.overrides]
    with logfile.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode


def initial_eval(args: argparse.Namespace, seed: int, path: Path | None = None) -> None:
    """The untrained policy on the held-out benchmarks for ``seed`` (``launch.eval``, once per study folder) into
    ``path`` (default ``<out>/initial/seed-<s>.json``)."""
    path = path or args.out / "initial" / f"seed-{seed}.json"
    if path.is_file() or not load_config(args.config, args.overrides).eval.benchmarks:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "launch.eval", "--config", args.config, "--out", str(path), *args.overrides,
           f"run.seed={seed}", *FIXED]  # fmt: skip
    with (path.parent / f"seed-{seed}.log").open("a") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    log.info("initial policy, seed %d: exit %d", seed, rc)


def model_change_for(args: argparse.Namespace, seed: int) -> str | None:
    """Why the configured model is not the one ``seed`` began with (:mod:`mugrpo_async.reporting.provenance`);
    None if it is or the seed has no untrained evaluation. A record without a digest is checked by evaluating the
    model again (``initial/seed-<s>.recheck.json``) and, when the scores agree, gains the digest."""
    path = args.out / "initial" / f"seed-{seed}.json"
    if not path.is_file():
        return None
    initial = json.loads(path.read_text())
    digest = weights_digest(load_config(args.config, args.overrides).model.path)
    rescored, older = None, "model_sha256" not in initial and digest is not None
    if older:
        recheck = path.with_name(f"seed-{seed}.recheck.json")
        recheck.unlink(missing_ok=True)
        initial_eval(args, seed, recheck)
        rescored = json.loads(recheck.read_text()) if recheck.is_file() else None
    why = model_change(initial, digest, rescored)
    if why is None and older:
        path.write_text(json.dumps({"model_sha256": digest, **initial}, indent=1))
    return why


def report(args: argparse.Namespace, runs: list[PlannedRun]) -> list[Path]:
    """Tables (``study.md``), per-run figures (``summary.json``) and the figures from the finished runs."""
    from launch.study_plot import plot_study

    done = [r for r in runs if run_status(r.path, load_config(args.config, r.overrides)) == "done"]
    initial = {s: initial_accuracy(args.out / "initial" / f"seed-{s}.json") for s in {r.seed for r in runs}}
    data = {}
    for r in done:
        data.setdefault(r.variant, []).append(load_run(r.path, r.variant, r.seed, initial[r.seed]))
    parted = stage_check(runs, data) if args.replay_from else {}
    summaries = [summarize_run(d) | {"arms": [] if parted.get((d.variant, d.seed)) else arm_names(d, args.arms_prefix),
                                     "figures": seed_figures(d)} for ds in data.values() for d in ds]  # fmt: skip
    measured = [a for _, a in sorted(initial.items()) if a is not None]
    text = study_report(aggregate_variants(summaries), measured) if summaries else "no finished runs\n"
    by_level = levels_table(data)
    text += f"\n{by_level}" if by_level else ""
    text += stage_section(parted) if args.replay_from else ""
    others = [json.loads((Path(d) / "summary.json").read_text()) for d in args.claims_with.split(",") if d.strip()]
    entries = [*summaries, *(e for o in others for e in o)]
    table3 = bmini_table(entries)
    late = late_table(entries, args.arms_prefix)
    named = any(c.arm.startswith(args.arms_prefix) for c in CLAIMS)  # "" and "p2/"; a second model's prefix is not
    claims = claims_report(entries) if named else consistency_report(entries, args.arms_prefix)
    text += ("\n" + table3 if table3 else "") + "\n" + claims + ("\n" + late if late else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "study.md").write_text(text)
    (args.out / "summary.json").write_text(json.dumps(summaries, indent=1))
    print(text)
    return [args.out / "study.md", *plot_study(data, args.plots or args.out / "plots")] if data else []


def stage_check(runs: list[PlannedRun], data: dict[str, list]) -> dict[tuple[str, int], str | None]:
    """Each finished run compared with its seed's fixed stage (:func:`~mugrpo_async.reporting.provenance.
    stage_mismatches`, with each seed's replay source as the reference): why it trained on another one, or None."""
    replays = {r.seed: r.replay for r in runs if r.replay is not None}
    own = {r.path: (r.variant, r.seed) for r in runs}  # a source inside this study is among data once it finished
    outside = {s: p for s, p in sorted(replays.items()) if p not in own and (p / "config.yaml").is_file()}
    first = [load_run(p, str(p), s) for s, p in outside.items()]
    sources = {own.get(p, (str(p), s)) for s, p in replays.items()}
    parted = stage_mismatches([*first, *(d for ds in data.values() for d in ds)], sources)
    for why in filter(None, parted.values()):
        log.warning("left out of the claims: %s", why)
    return parted


def stage_section(checked: dict[tuple[str, int], str | None]) -> str:
    """The stage check's lines in ``study.md``."""
    parted = [why for why in checked.values() if why]
    if not parted:
        return (f"\nStage check: {len(checked)} finished runs compared with their seed's stage at their B_mini (the "
                "run that generated it, or at another B_mini the seed's first run there); each saw the same token "
                "count and mean reward at every update.\n")  # fmt: skip
    return "\nStage check: left out of the claims, trained on another stage:\n" + "".join(f"- {w}\n" for w in parted)


def _has_figures(folder: Path) -> bool:
    """Whether ``folder/summary.json`` holds the per-seed figures of every run (a report of this version)."""
    path = folder / "summary.json"
    return path.is_file() and all("figures" in e and "arms" in e for e in json.loads(path.read_text()))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        runs = plan(args)
    except (KeyError, ValueError) as err:  # ConfigError is a ValueError
        print(f"error: {err.args[0] if err.args else err}", file=sys.stderr)
        return 2
    lacking = [d for d in args.claims_with.split(",") if d.strip() and not _has_figures(Path(d))]
    if lacking:
        print(f"error: --claims-with: no per-seed figures in {', '.join(lacking)}/summary.json (run its --report-only)",
              file=sys.stderr)  # fmt: skip
        return 2
    for r in runs:
        print(f"{r.status:>8}  {r.path}" + (f"  (replays {r.replay})" if r.replay else ""))
    if args.dry_run:
        return 0
    failed, changed, t0 = [], {}, time.perf_counter()
    for i, r in enumerate(runs if not args.report_only else []):
        if not args.skip_initial and (i == 0 or r.seed != runs[i - 1].seed):
            initial_eval(args, r.seed)
        if r.status == "done":
            continue
        if r.seed not in changed:
            changed[r.seed] = model_change_for(args, r.seed)
        blocker = replay_blocker(r) or (changed[r.seed] and f"the model is not the one seed {r.seed} began with: "
                                                            f"{changed[r.seed]}")  # fmt: skip
        if blocker:
            failed.append(f"{r.path} (not started: {blocker})")
            continue
        t1 = time.perf_counter()
        rc = train(args.config, r)
        log.info("run %d/%d %s seed %d: exit %d, %.0fs", i + 1, len(runs), r.variant, r.seed, rc,
                 time.perf_counter() - t1)  # fmt: skip
        if rc:
            failed.append(f"{r.path} (exit {rc}, log {r.path.parent / r.path.name}.log)")
    for p in report(args, runs):
        print(p)
    print(f"study wall time {time.perf_counter() - t0:.0f}s")
    if failed:
        print("failed runs:\n  " + "\n  ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
