"""Integration: nothing lost under faults (real Ray, vLLM, DeepSpeed, tiny model).

Killed drivers resume to the same update sequence and weights; missing and corrupt shards are the
only chunks generated again; a killed rollout worker is restarted and its chunk regenerated once; a
dead trainer rank stops the run with how to resume; an async run killed with groups queued serves
every group at most once after resuming.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
from safetensors.torch import load_file

from mugrpo_async.reporting.metrics import read_metrics
from mugrpo_async.rollout.shards import read_stage
from tests.conftest import REPO, tiny_config

pytestmark = pytest.mark.slow

SYNC = ["schedule.total_updates=8", "schedule.mu=4", "schedule.groups_per_update=4", "checkpoint.every_updates=1",
        "checkpoint.keep=3", "rollout.chunk_groups=4", "rollout.seeded_sampling=true"]  # fmt: skip


def _cmd(model, out, *overrides):
    return [sys.executable, "-m", "launch.train", "--config", "configs/tiny-cpu.yaml", f"model.path={model}",
            f"run.output_dir={out}", "run.dashboard=false", "logging.progress=false", *overrides]  # fmt: skip


def _env():
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def _run(model, out, *overrides, expect=0):
    proc = subprocess.run(_cmd(model, out, *overrides), cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=_env())  # fmt: skip
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


def _kill_after(model, out, update: int, *overrides) -> None:
    """Start a run and SIGKILL its whole process group once ``update`` is in metrics.jsonl."""
    proc = subprocess.Popen(_cmd(model, out, *overrides), cwd=REPO, env=_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            path = out / "metrics.jsonl"
            if path.is_file() and any(r.get("update", 0) >= update for r in _records(path)):
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run ended by itself ({proc.returncode}) before update {update}"


def _records(path):
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def _weights(folder):
    return load_file(str(folder / "checkpoints" / "final" / "model.safetensors"))


def _assert_equal_weights(a, b):
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0


def test_killed_driver_resumes_mid_stage_and_damaged_shards_regenerate_to_the_same_weights(tiny_model, tmp_path):
    run = tmp_path / "killed"
    _kill_after(tiny_model, run, 6, *SYNC)  # stage 1 (updates 5-8) is being optimized
    shards1 = {p.name: p.stat().st_mtime_ns for p in (run / "rollouts" / "stage-1").glob("shard-*")}
    ckpts = sorted((run / "checkpoints").glob("update-*"))
    newest = ckpts[-1] / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated: the resume must fall back to the one before
    proc = _run(tiny_model, run, *SYNC, "--resume")
    assert "truncated" in proc.stderr
    (resume,) = read_metrics(run, "resume")
    assert resume["from_update"] == int(ckpts[-2].name.split("-")[1]) and resume["skipped_checkpoints"]
    assert [r["update"] for r in read_metrics(run, "update")] == list(range(1, 9))
    stages = read_metrics(run, "stage")
    assert [s["stage"] for s in stages] == [0, 1]
    if resume["from_update"] > 4:  # resumed inside stage 1: its complete dataset was reused, not regenerated
        assert stages[1]["shards_reused"] == 4 and stages[1]["shards_generated"] == 0
        assert {p.name: p.stat().st_mtime_ns for p in (run / "rollouts" / "stage-1").glob("shard-*")} == shards1

    # The same stored datasets, with stage 1 damaged: only the missing and the corrupt chunk are generated
    # again, and (seeded sampling) they equal the lost ones, so training ends at the same weights.
    again = tmp_path / "damaged"
    shutil.copytree(run / "rollouts", again / "rollouts")
    (again / "rollouts" / "stage-1" / "shard-00001.msgpack").unlink()
    (again / "rollouts" / "stage-1" / "shard-00002.msgpack").write_bytes(b"\x93garbage")
    _run(tiny_model, again, *SYNC)
    stage0, stage1 = read_metrics(again, "stage")
    assert (stage0["shards_reused"], stage0["shards_generated"]) == (4, 0)
    assert (stage1["shards_reused"], stage1["shards_generated"], stage1["shards_corrupt"]) == (2, 2, 1)
    manifest, groups = read_stage(again / "rollouts" / "stage-1")
    assert manifest["complete"] and len(groups) == 16
    _assert_equal_weights(_weights(run), _weights(again))

    # A different configuration never continues this folder.
    proc = _run(tiny_model, run, *SYNC, "trainer.lr=0.5", expect=2)
    assert "another configuration" in proc.stderr or "different configuration" in proc.stderr


def _in_thread(fn, *args):
    box = {}

    def target():
        try:
            box["result"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            box["error"] = err

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def _named(kind: str, run_name: str):
    return [ray.get_actor(n) for n in ray.util.list_named_actors() if n.startswith(f"{run_name}-{kind}-")]


def _wait_for(cond, timeout=300):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_killed_rollout_worker_is_restarted_and_the_stage_has_each_group_once(tiny_model, tmp_path, ray_cluster):
    from drivers.sync import run_sync

    out = tmp_path / "worker-kill"
    cfg = tiny_config(tiny_model, out, ["run.name=wkill", "schedule.total_updates=2", "schedule.mu=2",
                                        "rollout.chunk_groups=1", "rollout.max_restarts=2"])  # fmt: skip
    thread, box = _in_thread(run_sync, cfg)
    _wait_for(lambda: len(list((out / "rollouts" / "stage-0").glob("shard-*"))) >= 1)
    (worker,) = _named("rollout", "wkill")
    ray.kill(worker, no_restart=False)  # mid-generation: Ray restarts it, the pool re-sends weights and the chunk
    thread.join(timeout=400)
    assert "error" not in box, box.get("error")
    (stage,) = read_metrics(out, "stage")
    assert stage["worker_failures"] >= 1 and stage["groups"] == 8
    manifest, groups = read_stage(out / "rollouts" / "stage-0")
    assert len(manifest["shards"]) == 8 and len({g.prompt_id for g in groups}) == 8


def test_dead_trainer_rank_stops_the_run_and_it_resumes(tiny_model, tmp_path, ray_cluster):
    from drivers.run import TrainerFailed
    from drivers.sync import run_sync

    out = tmp_path / "trainer-kill"
    overrides = ["run.name=tkill", "schedule.total_updates=8", "schedule.mu=4", "checkpoint.every_updates=2"]
    thread, box = _in_thread(run_sync, tiny_config(tiny_model, out, overrides))
    _wait_for(lambda: (out / "metrics.jsonl").is_file() and len(read_metrics(out, "update")) >= 3)
    (trainer,) = _named("trainer", "tkill")
    ray.kill(trainer, no_restart=True)
    thread.join(timeout=300)
    assert isinstance(box.get("error"), TrainerFailed), box
    assert "Resume" in str(box["error"]) and "checkpoint" in str(box["error"])
    end = run_sync(tiny_config(tiny_model, out, overrides))
    assert end["resumed_from_update"] >= 2
    assert [r["update"] for r in read_metrics(out, "update")] == list(range(1, 9))


def test_async_run_killed_with_groups_queued_resumes_without_losing_or_repeating_any(tiny_model, tmp_path):
    from mugrpo_async.rollout.shards import StageWriter

    out = tmp_path / "async"
    overrides = ["--mode", "async", "schedule.total_updates=12", "schedule.mu=8", "schedule.sync_every=2",
                 "schedule.groups_per_update=4", "checkpoint.every_updates=2", "rollout.batch_groups=4",
                 "schedule.queue_max_groups=16"]  # fmt: skip
    _kill_after(tiny_model, out, 5, *overrides)
    _run(tiny_model, out, *overrides)
    (resume,) = read_metrics(out, "resume")
    assert resume["from_update"] >= 4
    updates = read_metrics(out, "update")
    assert [r["update"] for r in updates] == list(range(1, 13))
    served = [uid for r in updates for uid in r["group_uids"]]
    assert len(served) == len(set(served)) == 48  # none served twice
    on_disk = StageWriter.open(out / "rollouts" / "async", "async", _digest(out)).all_groups()
    uids = [g.meta["uid"] for g in on_disk]
    assert len(uids) == len(set(uids)) and set(served) <= set(uids)  # every served group was kept on disk
    (end,) = read_metrics(out, "end")
    assert end["generated"] == len(on_disk) == end["served"] + end["dropped"] + end["left_in_queue"]


def _digest(run_dir):
    from mugrpo_async.config import load_config

    return load_config(run_dir / "config.yaml").resume_digest()


def test_hung_generation_times_out_and_stops_the_run_with_how_to_resume(tiny_model, tmp_path):
    # Every call outlasts a 50 ms deadline: the worker is killed and restarted until none is left.
    proc = _run(tiny_model, tmp_path / "hung", "schedule.total_updates=2", "schedule.mu=2",
                "schedule.groups_per_update=4", "rollout.generate_timeout_s=0.05", "rollout.max_restarts=1",
                expect=3)  # fmt: skip
    assert "rollout.generate_timeout_s" in proc.stderr and "resume" in proc.stderr and "Traceback" not in proc.stderr
