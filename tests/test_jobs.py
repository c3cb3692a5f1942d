"""Integration: the README's local try-out, both modes, and the run's monitoring through real components.

As the README says: a head started from the project's environment (the venv's bin first on PATH, as
`source .venv/bin/activate` leaves it), then `ray job submit --working-dir . -- python -m launch.train --config
configs/tiny-cpu.yaml ...` from the repo root. Each job must finish, its gauges must reach Ray's metrics export
with values metrics.jsonl recorded, its log must carry the status line, and `python -m launch.watch --once` must
show that line. The async job also serves the dashboard check: a real Prometheus (Debian's binary) on the scrape
config Ray writes for the session answers every panel query of monitoring/grafana/mugrpo_dashboard.json with a
series for the run, and its last idle ratio is the run's final one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from drivers.run import _free_port
from monitoring.dashboard import OUT as DASHBOARD
from monitoring.dashboard import queries, resolve
from mugrpo_async.reporting.metrics import read_metrics
from tests.conftest import REPO
from tests.prometheus_server import Prometheus, find_or_install, ray_scrape_config

pytestmark = pytest.mark.slow
VENV_BIN = Path(sys.executable).parent
TRAINER_GAUGES = {"mugrpo_trainer_idle_ratio", "mugrpo_lag_mean", "mugrpo_lag_max", "mugrpo_trainer_updates"}
QUEUE_GAUGES = {"mugrpo_queue_depth", "mugrpo_policy_version"}
SAMPLE = re.compile(r"^(?:ray_)?(mugrpo_\w+)\{(.*)\}\s+(\S+)$")  # Ray may prefix application metrics
STATUS = re.compile(r"status: (.*)$", re.M)
IDLE_TOL = 1e-9  # Prometheus keeps the exported float64 as is: the last idle ratio is the final update's exactly
RATE_WINDOW = "5s"  # $__rate_interval as Grafana sets it for a 1 s scrape interval: at least 4 scrapes


def activated_env() -> dict[str, str]:
    """The environment after `source .venv/bin/activate`, token auth off, metrics reported every second."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(VENV_BIN.parent),
            "RAY_AUTH_MODE": "disabled", "RAY_metrics_report_interval_ms": "1000"}  # fmt: skip


@pytest.fixture(scope="module")
def head():
    """A local Ray head started as the README starts it (its own temp dir, so its session is this one's)."""
    names = ("port", "dashboard", "metrics", "dashboard-agent-listen", "dashboard-agent-grpc", "runtime-env-agent",
             "ray-client-server")  # fmt: skip
    ports = {name: _free_port() for name in names}  # explicit ports: another cluster may hold the defaults
    env, temp = activated_env(), tempfile.mkdtemp(prefix="rayj")  # short: Ray's socket paths must stay short
    proc = subprocess.Popen(
        ["ray", "start", "--head", "--block", "--num-cpus=3", f"--port={ports['port']}", "--include-dashboard=true",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}", f"--temp-dir={temp}",
         f"--metrics-export-port={ports['metrics']}", "--disable-usage-stats",
         *(f"--{name}-port={ports[name]}" for name in names[3:])],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    address = f"http://127.0.0.1:{ports['dashboard']}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=2)
            break
        except OSError:
            time.sleep(1)
    else:
        proc.terminate()
        pytest.fail("the Ray head did not come up")
    yield {"address": address, "metrics": ports["metrics"], "env": env, "session": Path(temp) / "session_latest"}
    proc.terminate()
    proc.wait(timeout=60)
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def prometheus(head, tmp_path_factory):
    """Prometheus scraping the head with Ray's session config (scrape interval 1 s instead of 10 s, the rest as
    Ray wrote it); started before any job. Yields why not (a string) when there is no binary."""
    binary, why = find_or_install()
    if binary is None:
        yield why
        return
    config = ray_scrape_config(head["session"])
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    server = Prometheus(binary, config, tmp_path_factory.mktemp("prometheus"), _free_port())
    yield server
    server.stop()


@dataclass
class Job:
    out: Path
    run: str
    log: str
    t_start: float  # unix times around `ray job submit`
    t_end: float
    scrapes: list[dict[str, float]] = field(default_factory=list)


@pytest.fixture(scope="module")
def submit(head, prometheus, tiny_model, tmp_path_factory):
    """``submit(mode)``: the job of that mode, submitted once per module (the async one serves two tests)."""
    done: dict[str, Job] = {}

    def get(mode: str) -> Job:
        if mode not in done:
            done[mode] = _submit(head, tiny_model, tmp_path_factory.mktemp(mode), mode)
        return done[mode]

    return get


def _submit(head: dict, tiny_model: Path, out: Path, mode: str) -> Job:
    run = f"jobs-{mode}"  # the run tag tells this job's gauges from the other mode's
    cmd = ["ray", "job", "submit", f"--address={head['address']}", "--working-dir", ".", "--",
           "python", "-m", "launch.train", "--config", "configs/tiny-cpu.yaml", "--mode", mode,
           f"model.path={tiny_model}", f"run.output_dir={out}", f"run.name={run}", "logging.progress=false",
           "logging.status_every_s=2", "schedule.total_updates=16", "schedule.mu=8", "schedule.groups_per_update=4",
           "schedule.sync_every=2"]  # fmt: skip
    job = Job(out, run, "", time.time(), 0.0)
    for _ in range(20):  # a new head's job agent may not be up yet: it says so and we retry
        proc = subprocess.Popen(cmd, cwd=REPO, env=head["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)  # fmt: skip
        while proc.poll() is None:
            job.scrapes.append(_gauges(_scrape(head["metrics"]), run))
            time.sleep(0.5)
        job.log = proc.stdout.read()
        if "No available agent" not in job.log:
            break
        time.sleep(3)
    job.t_end = time.time()
    assert proc.returncode == 0, job.log[-3000:]
    assert "succeeded" in job.log
    return job


def _scrape(port: int) -> str:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return ""


def _gauges(text: str, run: str) -> dict[str, float]:
    """The ``mugrpo_*`` gauges tagged ``run=<run>`` in one Prometheus scrape."""
    found = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and f'run="{run}"' in m.group(2):
            found[m.group(1)] = float(m.group(3))
    return found


def _one_of(value: float, recorded: set) -> bool:
    return any(value == pytest.approx(r, rel=1e-6, abs=1e-9) for r in recorded)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_job_submit_finishes_and_exports_gauges(submit, head, mode):
    job = submit(mode)
    out, scrapes = job.out, job.scrapes
    wanted = TRAINER_GAUGES | (QUEUE_GAUGES if mode == "async" else set())
    # Values reported in the job's last second may reach the export after it ended: poll until every gauge
    # has been seen (Ray drops a dead worker's gauges only after a while).
    deadline = time.monotonic() + 120
    while not wanted <= {name for s in scrapes for name in s}:
        assert time.monotonic() < deadline, f"gauges never exported: {wanted - {n for s in scrapes for n in s}}"
        scrapes.append(_gauges(_scrape(head["metrics"]), job.run))
        time.sleep(0.5)
    updates = read_metrics(out, "update")
    (end,) = read_metrics(out, "end")
    assert [r["update"] for r in updates] == list(range(1, 17)) and end["updates"] == 16
    assert (out / "checkpoints" / "final" / "config.json").is_file()
    # Each exported value is one that the trainer (or the queue) had at some update, as metrics.jsonl records it.
    seen = {name: {s[name] for s in scrapes if name in s} for name in wanted}
    assert seen["mugrpo_trainer_updates"] <= set(range(1, 17))
    for key in ("trainer_idle_ratio", "lag_mean", "lag_max"):
        recorded = {r[key] for r in updates}
        assert all(_one_of(v, recorded) for v in seen[f"mugrpo_{key}"]), (key, seen[f"mugrpo_{key}"], recorded)
    if mode == "async":
        published = {0} | {r["update"] for r in updates if "t_weight_sync_s" in r}  # 0, 2, ..., 16
        assert published == set(range(0, 17, 2)) and seen["mugrpo_policy_version"] <= published
        assert all(0 <= v <= 36 for v in seen["mugrpo_queue_depth"])  # queue_max_groups 0: (mu + 1) x B_mini
    _check_status(job, updates[-1], end, mode)


def _check_status(job: Job, last: dict, end: dict, mode: str) -> None:
    """The job log's status lines (logging.status_every_s=2) end with the finished run's, and launch.watch shows
    that same line."""
    lines = STATUS.findall(job.log)
    assert len(lines) >= 2, job.log[-3000:]  # the tick at the run's start (and any later ones), and the final line
    final = lines[-1]
    assert final.startswith(f"{job.run} [{mode}] update 16/16 | idle {last['trainer_idle_ratio']:.3f} |")
    assert final.endswith(" finished") and f"(max {last['lag_max']})" in final
    served = end["served"] if mode == "async" else 16 * 4
    generated = end["generated"] if mode == "async" else 2 * 8 * 4  # two stages of mu x B_mini groups
    dropped = end["dropped"] if mode == "async" else 0
    assert f"groups generated {generated} served {served} dropped {dropped}" in final
    assert not any(line.endswith(("finished", "stopped")) for line in lines[:-1])  # the others: mid-run ticks
    shown = subprocess.run(["python", "-m", "launch.watch", str(job.out), "--once"], cwd=REPO, env=activated_env(),
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert shown.returncode == 0 and shown.stdout.splitlines()[0] == final, shown.stdout + shown.stderr


def test_dashboard_panels_through_prometheus(submit, prometheus):
    """Every panel query of the dashboard file, as Grafana sends it for the run, returns a series from Prometheus;
    the idle ratio panel's last value is the run's final trainer_idle_ratio (within IDLE_TOL)."""
    if isinstance(prometheus, str):
        pytest.skip(prometheus)
    job = submit("async")
    final_idle = read_metrics(job.out, "update")[-1]["trainer_idle_ratio"]
    panels = queries(json.loads(DASHBOARD.read_text()))
    deadline, missing, idle = time.monotonic() + 60, panels, None
    while True:  # the last values may reach the export (and the next scrape) after the job ended
        now = time.time()
        results = {expr: _series(prometheus, resolve(expr, job.run, RATE_WINDOW), job, now) for _, expr in panels}
        missing = [(title, expr) for title, expr in panels if not results[expr]]
        idle_expr = next(expr for title, expr in panels if "idle_ratio" in expr)
        idle = float(results[idle_expr][-1][1]) if results[idle_expr] else None
        if (not missing and idle is not None and abs(idle - final_idle) <= IDLE_TOL) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert prometheus.targets_up() >= 1
    assert not missing, f"panels without a series for {job.run}: {missing}"
    assert idle == pytest.approx(final_idle, abs=IDLE_TOL), (idle, final_idle)


def _series(prometheus: Prometheus, expr: str, job: Job, now: float) -> list:
    """The values of ``expr``'s one series for the job's run, over the job's time and since."""
    result = prometheus.query_range(expr, job.t_start - 5, now)
    assert all(r["metric"].get("run") == job.run for r in result) and len(result) <= 1, (expr, result)
    return result[0]["values"] if result else []
