"""Integration: `ray job submit` to a local head, both modes; the gauges reach Ray's metrics export."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from drivers.run import _free_port
from mugrpo_async.reporting.metrics import read_metrics
from tests.conftest import REPO

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).with_name("ray"))
TRAINER_GAUGES = {"mugrpo_trainer_idle_ratio", "mugrpo_lag_mean", "mugrpo_lag_max", "mugrpo_trainer_updates"}
QUEUE_GAUGES = {"mugrpo_queue_depth", "mugrpo_policy_version"}
SAMPLE = re.compile(r"^(?:ray_)?(mugrpo_\w+)\{(.*)\}\s+(\S+)$")  # Ray may prefix application metrics


@pytest.fixture(scope="module")
def head():
    """A local Ray head (token auth off, metrics reported every second), stopped with its process."""
    names = ("port", "dashboard", "metrics", "dashboard-agent-listen", "dashboard-agent-grpc", "runtime-env-agent",
             "ray-client-server")  # fmt: skip
    ports = {name: _free_port() for name in names}  # explicit ports: another cluster may hold the defaults
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "disabled",
           "RAY_metrics_report_interval_ms": "1000"}  # fmt: skip
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--num-cpus=3", f"--port={ports['port']}", "--include-dashboard=true",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
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
    yield {"address": address, "metrics": ports["metrics"], "env": env}
    proc.terminate()
    proc.wait(timeout=60)


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
def test_job_submit_finishes_and_exports_gauges(head, tiny_model, tmp_path, mode):
    out, run = tmp_path / mode, f"jobs-{mode}"  # the run tag tells this job's gauges from the other mode's
    cmd = [RAY, "job", "submit", f"--address={head['address']}", "--working-dir", str(REPO), "--",
           sys.executable, "-m", "launch.train", "--config", "configs/tiny-cpu.yaml", "--mode", mode,
           f"model.path={tiny_model}", f"run.output_dir={out}", f"run.name={run}", "logging.progress=false",
           "schedule.total_updates=16", "schedule.mu=8", "schedule.groups_per_update=4",
           "schedule.sync_every=2"]  # fmt: skip
    wanted = TRAINER_GAUGES | (QUEUE_GAUGES if mode == "async" else set())
    scrapes: list[dict[str, float]] = []
    for _ in range(20):  # a new head's job agent may not be up yet: it says so and we retry
        proc = subprocess.Popen(cmd, env=head["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            scrapes.append(_gauges(_scrape(head["metrics"]), run))
            time.sleep(0.5)
        log = proc.stdout.read()
        if "No available agent" not in log:
            break
        time.sleep(3)
    assert proc.returncode == 0, log[-3000:]
    assert "succeeded" in log
    # Values reported in the job's last second may reach the export after it ended: poll until every gauge
    # has been seen (Ray drops a dead worker's gauges only after a while).
    deadline = time.monotonic() + 120
    while not wanted <= {name for s in scrapes for name in s}:
        assert time.monotonic() < deadline, f"gauges never exported: {wanted - {n for s in scrapes for n in s}}"
        scrapes.append(_gauges(_scrape(head["metrics"]), run))
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
        assert all(0 <= v <= 16 for v in seen["mugrpo_queue_depth"])  # schedule.queue_max_groups: 4 x B_mini
