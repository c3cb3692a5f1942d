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


# More updates than a run does before it is killed: it can never end first. schedule.total_updates is not
# part of what a resumed run must match, so the resumed run asks for fewer.
UNFINISHABLE = "schedule.total_updates=4096"


def _kill_after(model, out, update: int, *overrides) -> None:
    """Start a run that cannot finish and SIGKILL its whole process group once ``update`` is in metrics.jsonl."""
    log = out.with_name(f"{out.name}.stderr")
    with log.open("w") as stderr:
        proc = subprocess.Popen(_cmd(model, out, *overrides, UNFINISHABLE), cwd=REPO, env=_env(),
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
    deadline = time.monotonic() + 400
    try:
        while proc.poll() is None and not _reached(out / "metrics.jsonl", update):
            assert time.monotonic() < deadline, f"update {update} not reached in 400 s"
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run stopped ({proc.returncode}): {log.read_text()[-3000:]}"


def _reached(path, update: int) -> bool:
    return path.is_file() and any(r.get("update", 0) >= update for r in _records(path))


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
    # Killed once update 7 is recorded: checkpoint 6 is sealed by then (it precedes update 7), 7 may be.
    _kill_after(tiny_model, run, 7, *SYNC)
    shards1 = {p.name: p.stat().st_mtime_ns for p in (run / "rollouts" / "stage-1").glob("shard-*")}
    ckpts = sorted((run / "checkpoints").glob("update-*"))
    newest = ckpts[-1] / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated: the resume must fall back to the one before
    proc = _run(tiny_model, run, *SYNC, "--resume")
    assert "truncated" in proc.stderr
    (resume,) = read_metrics(run, "resume")
    assert resume["from_update"] == int(ckpts[-2].name.split("-")[1]) and len(resume["skipped_checkpoints"]) == 1
    assert resume["from_update"] in (5, 6, 7)  # the newest was truncated: the one before, inside stage 1
    assert [r["update"] for r in read_metrics(run, "update")] == list(range(1, 9))
    stages = read_metrics(run, "stage")
    assert [s["stage"] for s in stages] == [0, 1]
    # resumed inside stage 1: its complete dataset was reused, not regenerated
    assert (stages[1]["shards_reused"], stages[1]["shards_generated"]) == (4, 0)
    assert stages[1]["resumed_at_update"] == resume["from_update"]
    assert len(shards1) == 4
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


def _wait_for(cond, box: dict, timeout=300):
    """Poll ``cond`` until it holds; fail at once if the run in the thread of ``box`` ended with an error."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert "error" not in box, box["error"]
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _engine_hangs():
    """A function for ``worker.__ray_call__``: from then on the rollout worker's engine never finishes a step."""

    def hang(worker) -> None:
        import threading

        never = threading.Event()
        worker.llm.llm_engine.step = lambda *args, **kwargs: never.wait()

    return hang


def _hang_workers(pool) -> None:
    ray.get([w.__ray_call__.remote(_engine_hangs()) for w in pool.workers])


def test_killed_rollout_worker_is_restarted_and_the_stage_has_each_group_once(
    tiny_model, tmp_path, ray_cluster, monkeypatch
):
    from drivers.rollout_pool import RolloutPool
    from drivers.sync import run_sync

    # Once chunk 0 is stored the worker's engine hangs, before the pool gives it chunk 1: it is killed while
    # generating chunk 1, whatever the speed of the machine.
    hung, real = threading.Event(), RolloutPool.generate

    def generate(pool, chunks, on_result):
        def keep_then_hang(c, out):
            on_result(c, out)
            if not hung.is_set():
                _hang_workers(pool)
                hung.set()

        return real(pool, chunks, keep_then_hang)

    monkeypatch.setattr(RolloutPool, "generate", generate)
    out = tmp_path / "worker-kill"
    cfg = tiny_config(tiny_model, out, ["run.name=wkill", "schedule.total_updates=2", "schedule.mu=2",
                                        "rollout.chunk_groups=1", "rollout.max_restarts=2"])  # fmt: skip
    thread, box = _in_thread(run_sync, cfg)
    assert hung.wait(timeout=400), box.get("error")
    stage_dir = out / "rollouts" / "stage-0"
    first = {p.name: p.stat().st_mtime_ns for p in stage_dir.glob("shard-*")}
    assert list(first) == ["shard-00000.msgpack"]
    (worker,) = _named("rollout", "wkill")
    ray.kill(worker, no_restart=False)  # Ray restarts it; the pool gives the restarted worker chunk 1 again
    thread.join(timeout=400)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    (stage,) = read_metrics(out, "stage")
    assert (stage["worker_failures"], stage["timeouts"], stage["retries"]) == (1, 0, 0)
    assert (stage["groups"], stage["shards_generated"], stage["shards_reused"]) == (8, 8, 0)
    manifest, groups = read_stage(stage_dir)
    assert [e["chunk"] for e in sorted(manifest["shards"], key=lambda e: e["chunk"])] == list(range(8))
    assert len({g.prompt_id for g in groups}) == len(groups) == 8 and {g.policy_version for g in groups} == {0}
    assert (stage_dir / "shard-00000.msgpack").stat().st_mtime_ns == first["shard-00000.msgpack"]  # kept, not redone


def test_dead_trainer_rank_stops_the_run_and_it_resumes(tiny_model, tmp_path, ray_cluster):
    from drivers.run import TrainerFailed
    from drivers.sync import run_sync

    out = tmp_path / "trainer-kill"
    overrides = ["run.name=tkill", "schedule.total_updates=8", "schedule.mu=4", "checkpoint.every_updates=2"]
    thread, box = _in_thread(run_sync, tiny_config(tiny_model, out, [*overrides, UNFINISHABLE]))
    # update 3 is recorded after checkpoint 2 is sealed; the run cannot end before the rank is killed
    _wait_for(lambda: _reached(out / "metrics.jsonl", 3), box)
    (trainer,) = _named("trainer", "tkill")
    ray.kill(trainer, no_restart=True)
    thread.join(timeout=300)
    assert isinstance(box.get("error"), TrainerFailed), box
    assert "Resume" in str(box["error"]) and "checkpoint" in str(box["error"])
    newest = sorted((out / "checkpoints").glob("update-*"))[-1]
    end = run_sync(tiny_config(tiny_model, out, overrides))
    assert end["resumed_from_update"] == int(newest.name.split("-")[1]) >= 2
    assert [r["update"] for r in read_metrics(out, "update")] == list(range(1, 9))


def test_async_run_killed_with_groups_queued_resumes_without_losing_or_repeating_any(tiny_model, tmp_path):
    out = tmp_path / "async"
    overrides = ["--mode", "async", "schedule.total_updates=12", "schedule.mu=8", "schedule.sync_every=2",
                 "schedule.groups_per_update=4", "checkpoint.every_updates=2", "rollout.batch_groups=4",
                 "schedule.queue_max_groups=16"]  # fmt: skip
    _kill_after(tiny_model, out, 5, *overrides)
    _run(tiny_model, out, *overrides)
    (resume,) = read_metrics(out, "resume")
    assert resume["from_update"] >= 4 and resume["from_update"] % 2 == 0  # checkpoint 4 precedes update 5
    updates = read_metrics(out, "update")
    assert [r["update"] for r in updates] == list(range(1, 13))
    served = [uid for r in updates for uid in r["group_uids"]]
    assert len(served) == len(set(served)) == 48  # none served twice
    _, on_disk = read_stage(out / "rollouts" / "async")
    uids = [g.meta["uid"] for g in on_disk]
    assert len(uids) == len(set(uids)) and set(served) <= set(uids)  # every served group was kept on disk
    (end,) = read_metrics(out, "end")
    assert end["generated"] == len(on_disk) == end["served"] + end["dropped"] + end["left_in_queue"]
    assert end["served"] == 48 and end["resumed_from_update"] == resume["from_update"]


def main_with_hung_engines(argv: list[str]) -> int:
    """``python -m launch.train`` whose rollout workers' engines hang before the first generation call."""
    from drivers.rollout_pool import RolloutPool
    from launch.train import main

    real = RolloutPool.generate

    def generate(pool, chunks, on_result):
        _hang_workers(pool)
        return real(pool, chunks, on_result)

    RolloutPool.generate = generate
    return main(argv)


def test_hung_generation_times_out_and_stops_the_run_with_how_to_resume(tiny_model, tmp_path):
    # The engine never finishes a step (the call cannot end, however long the deadline): no token and no group
    # for rollout.stall_timeout_s, so its worker is killed, no restart is allowed, and with no worker left the
    # run stops saying how to resume.
    out = tmp_path / "hung"
    code = "import sys; from tests.test_faults import main_with_hung_engines as m; sys.exit(m(sys.argv[1:]))"
    args = _cmd(tiny_model, out, "schedule.total_updates=2", "schedule.mu=2", "schedule.groups_per_update=4",
                "rollout.stall_timeout_s=5", "rollout.max_restarts=0")[3:]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=_env())  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "chunk 0: no progress for rollout.stall_timeout_s=5s" in proc.stderr
    assert "no rollout worker is left alive" in proc.stderr and "resume" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((out / "rollouts" / "stage-0").glob("shard-*")) and read_metrics(out, "stage") == []
