"""Profile a training run with py-spy: the driver, the trainer rank and the rollout worker, sampled together.

Starts the training CLI, waits for its actors (``ray::TrainerRank``, ``ray::RolloutWorker``: descendants of
that CLI process only), records each with ``py-spy record --format raw`` for the run's life and prints,
per process, the functions with the most samples (inclusive and self), as markdown. py-spy comes from the
benchmark environment (``.cache/bench-venv``) or the project's.

    .venv/bin/python -m bench.pyspy_profile --config configs/tiny-cpu.yaml [--top 12] [dotted.key=value ...]
"""

from __future__ import annotations

import argparse
import collections
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import BENCH_VENV, REPO, md_table, run_env

log = logging.getLogger("bench.profile")
ROLES = {"driver": "launch.train", "trainer": "ray::TrainerRank", "rollout": "ray::RolloutWorker"}


def py_spy() -> str:
    for cand in (BENCH_VENV / "bin" / "py-spy", REPO / ".venv" / "bin" / "py-spy"):
        if cand.is_file():
            return str(cand)
    found = shutil.which("py-spy")
    if not found:
        raise SystemExit("py-spy not found: install it into .cache/bench-venv (pip install py-spy)")
    return found


def find_actors(root_pid: int, timeout_s: float = 120) -> dict[str, int]:
    """PIDs of the driver and its trainer/rollout actor processes (descendants of ``root_pid``)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    found = {"driver": root_pid}
    while time.monotonic() < deadline and len(found) < len(ROLES):
        try:
            for child in psutil.Process(root_pid).children(recursive=True):
                title = " ".join(child.cmdline())
                for role, mark in ROLES.items():
                    if role != "driver" and title.startswith(mark) and role not in found:
                        found[role] = child.pid
        except psutil.Error:
            break
        time.sleep(0.5)
    return found


PROJECT = ("actors/", "launch/", "mugrpo_async/", "bench/")


def _frame(raw: str) -> tuple[str, bool]:
    """("function (file)", is a project frame) from py-spy's "function (path/file.py:line)"."""
    func, _, where = raw.partition(" (")
    path = where.split(":")[0]
    return f"{func} ({path.rsplit('/', 1)[-1]})", path.startswith(PROJECT)


def summarize(raw: Path, top: int) -> tuple[list, int]:
    """Top project functions by inclusive samples, then top functions by self samples; and the total."""
    incl, self_ = collections.Counter(), collections.Counter()
    project: set[str] = set()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), [_frame(f) for f in stack.split(";")]
        total += n
        for name, mine in set(frames):
            incl[name] += n
            if mine:
                project.add(name)
        self_[frames[-1][0]] += n
    ours = [(name, c) for name, c in incl.most_common() if name in project][:top]
    rows = [[name, f"{c / total:.0%}", f"{self_[name] / total:.0%}"] for name, c in ours]
    tops = [[name, f"{incl[name] / total:.0%}", f"{c / total:.0%}"] for name, c in self_.most_common(top)]
    return [["**project functions (inclusive)**", "", ""], *rows, ["**all functions (self)**", "", ""], *tops], total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pyspy_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-cpu.yaml")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tmp = Path(tempfile.mkdtemp(prefix="mugrpo-profile-"))
    argv_run = [
        sys.executable,
        "-m",
        "launch.train",
        "--config",
        args.config,
        f"run.output_dir={tmp / 'run'}",
        "run.dashboard=false",
        "logging.progress=false",
        *args.overrides,
    ]
    run = subprocess.Popen(argv_run, cwd=REPO, env=run_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = find_actors(run.pid)
    spies = {
        role: subprocess.Popen(
            [
                py_spy(),
                "record",
                "--format",
                "raw",
                "-r",
                str(args.rate),
                "-p",
                str(pid),
                "-o",
                str(tmp / f"{role}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for role, pid in pids.items()
    }
    rc = run.wait()
    for spy in spies.values():
        spy.wait(timeout=60)
    print(
        f"# py-spy profile of `python -m launch.train --config {args.config} {' '.join(args.overrides)}` (exit {rc})\n"
    )
    for role in spies:
        raw = tmp / f"{role}.txt"
        if not raw.is_file():
            print(f"{role}: no samples\n")
            continue
        rows, total = summarize(raw, args.top)
        print(f"## {role} ({total} samples at {args.rate}/s, idle excluded)\n")
        print(md_table(["function (file)", "inclusive", "self"], rows) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
