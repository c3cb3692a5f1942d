"""A real Prometheus for integration tests: Debian's binary on Ray's own scrape config, and its HTTP API.

The binary is the one on PATH, else Debian's ``prometheus`` package is installed (``apt-get install``, root only)
with the package's service kept from starting; the daemon the tests use is this process alone, on a free port
with its storage in a temporary folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

POLICY_RC = Path("/usr/sbin/policy-rc.d")  # Debian's hook that lets package scripts start services, or not


def find_or_install() -> tuple[str | None, str]:
    """(path of the prometheus binary, "") or (None, why there is none)."""
    found = shutil.which("prometheus")
    if found:
        return found, ""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "prometheus is not installed and installing it needs root and apt-get (apt-get install prometheus)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]
    guard = not POLICY_RC.exists()
    if guard:  # exit 101: "action forbidden", so the package's own daemon is not started
        POLICY_RC.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC.chmod(0o755)
    try:
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:  # stale package lists: refresh once
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
            done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    finally:
        if guard:
            POLICY_RC.unlink()
    found = shutil.which("prometheus")
    return (found, "") if found else (None, f"apt-get install prometheus failed: {done.stderr.strip()[-400:]}")


def ray_scrape_config(session_dir: Path, timeout_s: float = 60) -> dict:
    """The scrape config Ray writes for its session (``<session>/metrics/prometheus/prometheus.yml``)."""
    path = session_dir / "metrics" / "prometheus" / "prometheus.yml"
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise FileNotFoundError(f"{path}: Ray wrote no Prometheus config")
        time.sleep(0.5)
    return yaml.safe_load(path.read_text())


class Prometheus:
    """``prometheus`` running on ``config`` at 127.0.0.1:``port``, its data under ``folder``; :meth:`stop` ends it."""

    def __init__(self, binary: str, config: dict, folder: Path, port: int):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{port}"
        self.log = folder / "prometheus.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=2)
                return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("prometheus did not become ready")

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        """``/api/v1/query_range``: the series (``{"metric": {...}, "values": [[t, "v"], ...]}``) of ``expr``."""
        args = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query_range?{args}", timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as err:  # a bad query: Prometheus says why in the body
            raise RuntimeError(f"{expr}: {err.read().decode()[:500]}") from None
        if body["status"] != "success":
            raise RuntimeError(f"{expr}: {body}")
        return body["data"]["result"]

    def targets_up(self) -> int:
        """How many scrape targets Prometheus found and scraped successfully."""
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as resp:
            active = json.loads(resp.read())["data"]["activeTargets"]
        return sum(t["health"] == "up" for t in active)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
