"""Integration: `ray job submit` to a local head, both modes; the gauges reach Ray's metrics export."""

from __future__ import annotations

import os
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
GAUGES = ("mugrpo_trainer_idle_ratio", "mugrpo_lag_mean", "mugrpo_queue_depth", "mugrpo_policy_version")


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


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_job_submit_finishes_and_exports_gauges(head, tiny_model, tmp_path, mode):
    out = tmp_path / mode
    cmd = [RAY, "job", "submit", f"--address={head['address']}", "--working-dir", str(REPO), "--",
           sys.executable, "-m", "launch.train", "--config", "configs/tiny-cpu.yaml", "--mode", mode,
           f"model.path={tiny_model}", f"run.output_dir={out}", "logging.progress=false",
           "schedule.total_updates=16", "schedule.mu=8", "schedule.groups_per_update=4",
           "schedule.sync_every=2"]  # fmt: skip
    seen: set[str] = set()
    for _ in range(20):  # a new head's job agent may not be up yet: it says so and we retry
        proc = subprocess.Popen(cmd, env=head["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            text = _scrape(head["metrics"])
            seen |= {name for name in GAUGES if name in text}
            time.sleep(1)
        log = proc.stdout.read()
        if "No available agent" not in log:
            break
        time.sleep(3)
    assert proc.returncode == 0, log[-3000:]
    assert "succeeded" in log
    assert len(read_metrics(out, "update")) == 16 and read_metrics(out, "end")
    assert (out / "checkpoints" / "final" / "config.json").is_file()
    assert {"mugrpo_trainer_idle_ratio", "mugrpo_lag_mean"} <= seen
    if mode == "async":
        assert {"mugrpo_queue_depth", "mugrpo_policy_version"} <= seen
