"""Integration: an actor's death stops the run clearly, and the same command resumes it.

Each test runs ``python -m launch.train`` as a subprocess (its own local Ray cluster, the real vLLM and
DeepSpeed, the tiny model) and SIGKILLs one of that run's actor processes, found among the run's own
descendants, once a given update is in metrics.jsonl. The run must end with exit code 3 and one line naming
the newest checkpoint and the exact command that resumes it, without a traceback; a worker killed while it
evaluates in sync mode is the one death the run survives (restarted, its share evaluated again).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mugrpo_async.reporting.metrics import read_metrics
from mugrpo_async.rollout.shards import read_stage
from tests.conftest import REPO

pytestmark = pytest.mark.slow

ASYNC = ["--mode", "async", "schedule.total_updates=16", "schedule.mu=8", "schedule.sync_every=2",
         "schedule.groups_per_update=4", "checkpoint.every_updates=2", "rollout.batch_groups=4",
         "schedule.queue_max_groups=16"]  # fmt: skip


def _cmd(model, out, *overrides) -> list[str]:
    return [sys.executable, "-m", "launch.train", "--config", "configs/tiny-cpu.yaml", f"model.path={model}",
            f"run.output_dir={out}", "run.dashboard=false", "logging.progress=false", *overrides]  # fmt: skip


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a cluster of its own


def _updates_done(out: Path) -> int:
    path = out / "metrics.jsonl"
    done = 0
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except ValueError:  # a line being written
            continue
        if rec.get("kind") == "update":
            done = max(done, rec["update"])
    return done


def _actor_pids(driver: int, actor_class: str) -> list[int]:
    """The processes of ``actor_class`` actors of the run whose driver is ``driver`` (its Ray is its own)."""
    found = []
    for proc in psutil.Process(driver).children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:  # ended meanwhile
            continue
        if title.startswith(f"ray::{actor_class}"):  # Ray names an actor's process after its class
            found.append(proc.pid)
    return found


def _kill_actor_after(cmd: list[str], out: Path, update: int, actor_class: str, ready=None):
    """Run ``cmd``; once ``update`` is recorded (and ``ready(out)``), SIGKILL its ``actor_class`` actor; wait."""
    log = out.with_name(f"{out.name}.stderr")
    with log.open("w") as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=stderr, text=True,
                                start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 500
    try:
        while proc.poll() is None and not (_updates_done(out) >= update and (ready is None or ready(out))):
            assert time.monotonic() < deadline, f"update {update} not reached in 500 s"
            time.sleep(0.01)
        assert proc.poll() is None, f"the run ended ({proc.returncode}) first: {log.read_text()[-3000:]}"
        (pid,) = _actor_pids(proc.pid, actor_class)
        os.kill(pid, signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, log.read_text())


def _assert_clear_stop(proc: subprocess.CompletedProcess, out: Path, cause: str) -> Path | None:
    """Exit 3; one line naming ``cause``, the newest checkpoint and the command; no traceback. The checkpoint."""
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error: the run stopped:")]
    assert cause in line, line
    newest = sorted((out / "checkpoints").glob("update-*"))
    named = line.split("newest checkpoint: ")[1].split(";")[0]
    assert named == (str(newest[-1]) if newest else "none (the run starts again from update 0)"), line
    assert line.endswith(f"resume with: {shlex.join(proc.args)}"), line
    return newest[-1] if newest else None


def test_dead_sample_queue_stops_the_async_run_and_the_same_command_resumes_it(tiny_model, tmp_path):
    out = tmp_path / "queue"
    cmd = _cmd(tiny_model, out, *ASYNC)
    # update 5 is recorded after checkpoint 4 is sealed (sealed while update 5 runs)
    proc = _kill_actor_after(cmd, out, 5, "SampleQueue")
    newest = _assert_clear_stop(proc, out, "the sample queue actor died")
    assert newest is not None and int(newest.name.split("-")[1]) >= 4
    assert _updates_done(out) < 16

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=_env())
    assert again.returncode == 0, again.stderr[-3000:]
    (resume,) = read_metrics(out, "resume")
    assert resume["checkpoint"] == str(newest) and resume["from_update"] == int(newest.name.split("-")[1])
    updates = read_metrics(out, "update")
    assert [r["update"] for r in updates] == list(range(1, 17))  # every update once, in order
    served = [uid for r in updates for uid in r["group_uids"]]
    assert len(served) == len(set(served)) == 16 * 4  # no group served twice
    _, stored = read_stage(out / "rollouts" / "async")
    uids = [g.meta["uid"] for g in stored]
    assert len(uids) == len(set(uids)) and set(served) <= set(uids)
    (end,) = read_metrics(out, "end")
    assert end["generated"] == len(stored) == end["served"] + end["dropped"] + end["left_in_queue"]
    assert end["served"] == 64 and end["resumed_from_update"] == resume["from_update"]


def test_rollout_worker_past_its_restarts_stops_the_async_run(tiny_model, tmp_path):
    out = tmp_path / "worker"
    proc = _kill_actor_after(_cmd(tiny_model, out, *ASYNC, "rollout.max_restarts=0"), out, 3, "RolloutWorker")
    newest = _assert_clear_stop(proc, out, "rollout worker 0 died and was not restarted (rollout.max_restarts=0)")
    assert newest is not None and int(newest.name.split("-")[1]) >= 2  # sealed while update 3 ran
    assert _updates_done(out) < 16


def test_worker_dying_during_a_sync_evaluation_is_restarted_and_its_share_evaluated_again(tiny_model, tmp_path):
    out = tmp_path / "eval"
    # One stage of 4 updates, a large evaluation (2048 samples) after update 2: the worker is killed while it
    # evaluates (or loads the weights for it) and Ray restarts it; the restarted worker gets the evaluated
    # weights and its share of the problems again, so the evaluation is recorded once and the run goes on.
    cmd = _cmd(tiny_model, out, "schedule.total_updates=4", "schedule.mu=4", "schedule.groups_per_update=4",
               "checkpoint.every_updates=1", "eval.benchmarks=[heldout]", "eval.every_updates=2",
               "eval.num_problems=512", "eval.n_samples=4")  # fmt: skip
    proc = _kill_actor_after(cmd, out, 2, "RolloutWorker", ready=lambda o: not read_metrics(o, "eval"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = read_metrics(out, "eval")
    assert [e["update"] for e in evals] == [2, 4]
    assert [e["eval_worker_restarts"] for e in evals] == [1, 0] and evals[0]["eval_shares"] == 1
    heldout = evals[0]["benchmarks"]["heldout"]
    assert heldout["problems"] + heldout["dropped"] == 512
    assert _updates_done(out) == 4
