"""Run the staleness study's learning-rate pilot and decide the rate (docs/STUDY.md, "Learning-rate pilot").

    python -m launch.pilot --config configs/study/steps.yaml --out runs/study-pilot [--rates 3e-4,1e-4,3e-5]
        [--runs a,b] [--dry-run | --report-only] [dotted.key=value ...]

Per rate, two one-run studies through ``launch.study`` on seed 100 (resumable: a finished run is skipped, a started
one resumed): (a) ``<out>/a-lr<rate>``, GRPO at mu = 4 (variant ``grpo_mu4``) over the config's 1024 updates,
evaluated on the held-out set; (b) ``<out>/b-lr<rate>``, mu-GRPO (``mu_grpo``) over one fixed stage at the config's
mu = 1024 without evaluation, all replaying one stage of seed 100: the stage of the largest rate whose (b) run
has already finished in ``<out>``, else the one the first rate's (b) run generates. The untrained policy is scored
once (``<out>/initial/seed-100.json``). Then the rules of :mod:`mugrpo_async.reporting.pilot` write
``<out>/pilot.json`` and ``<out>/pilot.md`` over every rate piloted in ``<out>`` (a later ``--rates 1e-5`` is
decided together with the rates before it): each rate's held-out points, veto fraction and verdicts, and the rate
the study uses or what to pilot next. ``--runs a`` (or ``b``) runs one kind only, so a session can finish one run
and the decision waits for the rest.
Exit code 2: bad arguments or config; 1: a run failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from launch import study
from mugrpo_async.reporting.metrics import read_metrics
from mugrpo_async.reporting.pilot import RATES, SEED, decide, improves_steadily, rate_result, veto_in_range
from mugrpo_async.reporting.study import initial_accuracy

log = logging.getLogger("launch.pilot")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.pilot", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the study's config (configs/study/steps.yaml)")
    p.add_argument("--out", type=Path, default=Path("runs/study-pilot"), help="pilot folder")
    p.add_argument("--rates", default=",".join(RATES), help="comma-separated trainer.lr values (the design's)")
    p.add_argument("--runs", default="a,b", help="which runs of each rate: a (GRPO mu=4), b (mu-GRPO stage 0)")
    p.add_argument("--dry-run", action="store_true", help="list the runs with their status; run nothing")
    p.add_argument("--report-only", action="store_true", help="only the decision from the finished runs")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every run")
    return p


def study_argv(args: argparse.Namespace, kind: str, rate: str, first: str) -> list[str]:
    """``launch.study`` arguments of run ``kind`` (a or b) at ``rate``; ``first``: the rate whose (b) run
    generates (or generated) the stage."""
    argv = ["--config", args.config, "--out", str(args.out / f"{kind}-lr{rate}"), "--seeds", str(SEED),
            "--skip-initial", *args.overrides, f"trainer.lr={rate}"]  # fmt: skip
    if kind == "a":
        return [*argv, "--variants", "grpo_mu4"]
    argv += ["--variants", "mu_grpo", "eval.benchmarks=[]"]
    return argv if rate == first else [*argv, "--replay-from", str(args.out / f"b-lr{first}" / "mu_grpo")]


def _records(folder: Path) -> list[dict] | None:
    return read_metrics(folder) if (folder / "metrics.jsonl").is_file() else None


def _run_folder(out: Path, kind: str, rate: str) -> Path:
    return out / f"{kind}-lr{rate}" / ("grpo_mu4" if kind == "a" else "mu_grpo") / f"seed-{SEED}"


def piloted(out: Path, rates: list[str]) -> list[str]:
    """``rates`` and every rate with a run folder in ``out``, largest first (a rate given keeps its spelling); a
    folder whose name does not end in a number (``a-lr-old``) is not a rate's and is left out, with a warning."""
    found = {d.name.split("-lr", 1)[1] for d in out.glob("[ab]-lr*") if d.is_dir()} if out.is_dir() else set()
    for name in sorted(n for n in found if not _is_number(n)):
        log.warning("%s: ignoring the folder(s) *-lr%s, whose name is not a learning rate", out, name)
        found.discard(name)
    seen = {float(r): r for r in [*sorted(found), *rates]}  # a given spelling wins over a folder's
    return [seen[v] for v in sorted(seen, reverse=True)]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def stage_source(out: Path, rates: list[str]) -> str:
    """The rate whose (b) run holds the stage every (b) run replays: the largest with a finished (b) run in
    ``out``, else the first of ``rates`` (its run generates the stage)."""
    for rate in piloted(out, []):
        records = _records(_run_folder(out, "b", rate))
        if records and any(r.get("kind") == "end" for r in records):
            return rate
    return rates[0]


def report(args: argparse.Namespace, rates: list[str]) -> dict:
    """Each rate's figures and verdicts, and the decision; written to ``pilot.json`` and ``pilot.md``."""
    initial = initial_accuracy(args.out / "initial" / f"seed-{SEED}.json")
    results = [rate_result(float(r), _records(_run_folder(args.out, "a", r)), _records(_run_folder(args.out, "b", r)),
                           initial) for r in rates]  # fmt: skip
    decision = decide(results)
    rows = ["| lr | held-out points (update: accuracy) | improves steadily | stage-0 veto fraction | in range |",
            "|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        pts = ", ".join(f"{u}: {a:.3f}" for u, a in sorted(r.points.items())) or "not finished"
        steady = "-" if not r.points else _steady_text(r.points, initial or 0.0)
        veto = "not finished" if r.veto_frac is None else f"{r.veto_frac:.2%}"
        rows.append(f"| {r.lr:g} | {pts} | {steady} | {veto} | "
                    f"{'-' if r.veto_frac is None else ('yes' if veto_in_range(r.veto_frac) else 'no')} |")  # fmt: skip
    text = "\n".join([f"untrained held-out accuracy: {initial}", "", *rows, "", f"decision: {decision}", ""])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pilot.md").write_text(text)
    (args.out / "pilot.json").write_text(json.dumps({"initial": initial, "results": [vars(r) for r in results],
                                                     "decision": decision}, indent=1))  # fmt: skip
    print(text)
    return decision


def _steady_text(points: dict[int, float], initial: float) -> str:
    try:
        ok, failed = improves_steadily(points, initial)
    except ValueError as err:
        return str(err)
    return "yes" if ok else "no: " + "; ".join(failed)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    kinds = [k.strip() for k in args.runs.split(",") if k.strip()]
    if not rates or any(k not in ("a", "b") for k in kinds):
        print("error: --rates needs a rate and --runs takes a and/or b", file=sys.stderr)
        return 2
    failed = 0
    if not args.report_only:
        if not args.dry_run and "a" in kinds:  # the untrained policy, once, on the same held-out set
            study.initial_eval(argparse.Namespace(out=args.out, config=args.config, overrides=args.overrides), SEED)
        first = stage_source(args.out, rates)
        for kind in ("b", "a"):  # (b) runs first: the stage's generating run before those that replay it
            for rate in sorted(rates, key=lambda r: r != first) if kind in kinds else []:
                rc = study.main([*study_argv(args, kind, rate, first), *(["--dry-run"] if args.dry_run else [])])
                if rc == 2:
                    return 2
                failed += rc != 0
    if not args.dry_run:
        report(args, piloted(args.out, rates))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
