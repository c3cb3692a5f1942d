"""Unit tests of what resuming relies on (no Ray): state files, checkpoint store, stage reopening, queue restore."""

from __future__ import annotations

import json

import pytest
import torch

from mugrpo_async.checkpoints.state_io import StateFormatError, load_tree, save_tree
from mugrpo_async.checkpoints.store import CheckpointError, CheckpointStore, find_resumable, verify_checkpoint
from mugrpo_async.reporting.metrics import MetricsSink, read_metrics
from mugrpo_async.rollout.samples import Group, SampleError
from mugrpo_async.rollout.shards import StageWriter, read_stage
from mugrpo_async.rollout.staleness import LagQueue


class Live:
    """Stands for an object a state file cannot hold (e.g. DeepSpeed's loss scaler)."""


def test_state_tree_round_trip_keeps_tensors_int_keys_and_live_objects(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    live = Live()
    tree = {"opt": opt.state_dict(), "rng": torch.get_rng_state(), "scaler": live, "inf": float("inf"), "t": (1, 2)}
    save_tree(tree, tmp_path / "rank-0")
    assert not list(tmp_path.glob("*.pt")) and (tmp_path / "rank-0.safetensors").is_file()
    back = load_tree(tmp_path / "rank-0", template={"scaler": "from-template"})
    assert back["scaler"] == "from-template" and back["inf"] == float("inf") and back["t"] == (1, 2)
    assert set(back["opt"]["state"]) == {0, 1}  # int keys survive JSON
    for k in (0, 1):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(back["opt"]["state"][k][name], opt.state_dict()["state"][k][name])
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.5)
    fresh.load_state_dict(back["opt"])
    assert fresh.param_groups[0]["lr"] == 0.1
    assert torch.equal(back["rng"], tree["rng"])


def test_state_tree_live_leaf_without_template_is_an_error(tmp_path):
    save_tree({"x": Live()}, tmp_path / "s")
    with pytest.raises(StateFormatError, match="/x"):
        load_tree(tmp_path / "s")
    (tmp_path / "s.safetensors").write_bytes(b"garbage")
    with pytest.raises(StateFormatError, match="unreadable"):
        load_tree(tmp_path / "s", template={"x": 1})


def _checkpoint(store: CheckpointStore, update: int, digest: str = "d") -> None:
    tmp = store.begin(update)
    (tmp / "model.safetensors").write_bytes(b"w" * 100)
    (tmp / "trainer" / "rank-0.json").write_text("{}")
    store.commit(tmp, {"update": update, "config_digest": digest})


def test_checkpoint_store_commits_atomically_keeps_newest_and_skips_truncated(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for u in (2, 4, 6):
        _checkpoint(store, u)
    assert [p.name for p in store.checkpoints()] == ["update-00000004", "update-00000006"]
    assert not list((tmp_path / "checkpoints").glob(".*tmp"))
    assert verify_checkpoint(store.path_for(6))["update"] == 6
    (store.path_for(6) / "model.safetensors").write_bytes(b"w" * 50)  # truncated
    found = store.latest_valid("d")
    assert found.update == 4 and "truncated" in found.skipped[0]
    (store.path_for(4) / "model.safetensors").write_bytes(b"x" * 100)  # same size, corrupt
    found = store.latest_valid("d")
    assert found.state is None and "sha256" in found.skipped[1]
    store.begin(8)  # a crash mid-write leaves only a temporary folder, never a checkpoint
    assert [p.name for p in store.checkpoints()] == ["update-00000004", "update-00000006"]


def test_find_resumable_applies_the_resume_policy(tmp_path):
    empty = tmp_path / "new"
    assert find_resumable(empty, "auto", "d").state is None and not find_resumable(empty, "auto", "d").found_run
    with pytest.raises(CheckpointError, match="nothing to resume"):
        find_resumable(empty, "must", "d")
    _checkpoint(CheckpointStore(tmp_path / "old"), 3)
    assert find_resumable(tmp_path / "old", "must", "d").update == 3
    with pytest.raises(CheckpointError, match="already holds a run"):
        find_resumable(tmp_path / "old", "never", "d")
    with pytest.raises(CheckpointError, match="different configuration"):
        find_resumable(tmp_path / "old", "auto", "other")


def _group(pid: str, version: int = 0) -> Group:
    return Group(prompt_id=pid, prompt_ids=[1, 2], answer="3", responses=[[4, 5], [6]], behavior_logprobs=[[-1.0, -2.0],
                 [-0.5]], rewards=[1.0, 0.0], advantages=[0.7, -0.7], policy_version=version,
                 finish_reasons=["stop", "length"])  # fmt: skip


def test_stage_writer_reopens_keeps_good_shards_and_regenerates_corrupt_or_missing(tmp_path):
    w = StageWriter(tmp_path / "stage-0", 0, "d", num_chunks=4, chunk_size=1)
    for c in (0, 1, 2):
        w.add([_group(f"p{c}")], c)
    (tmp_path / "stage-0" / "shard-00001.msgpack").write_bytes(b"\x00" * 10)  # corrupt; chunk 3 never written
    again = StageWriter.open(tmp_path / "stage-0", 0, "d", num_chunks=4, chunk_size=1)
    assert again.missing() == [1, 3] and again.corrupt == ["shard-00001.msgpack"]
    with pytest.raises(SampleError, match="missing"):
        again.finish()
    for c in (3, 1):
        again.add([_group(f"p{c}")], c)
    with pytest.raises(SampleError, match="twice"):
        again.add([_group("p1")], 1)
    again.finish()
    manifest, groups = read_stage(tmp_path / "stage-0")
    assert manifest["complete"] and [g.prompt_id for g in groups] == ["p0", "p1", "p2", "p3"]
    assert manifest["totals"]["groups"] == 4 and [h["event"] for h in manifest["history"]] == ["created", "reopened"]
    with pytest.raises(SampleError, match="another configuration"):
        StageWriter.open(tmp_path / "stage-0", 0, "other", num_chunks=4, chunk_size=1)


def test_lag_queue_restore_and_dead_worker_release_keep_the_accounting():
    q = LagQueue(mu=4, groups_per_update=2, max_groups=8)
    assert q.reserve(3, 0, worker=0) == 3 and q.reserve(2, 0, worker=1) == 2
    q.put(["a", "b"], [0, 0], worker=0)
    assert q.release_worker(0) == 1 and q.release_worker(1) == 2  # both died with reservations
    with pytest.raises(ValueError, match="worker 1"):
        q.put(["c"], [0], worker=1)
    assert q.take(0) == (["a", "b"], [0, 0])
    s = q.stats()
    assert s["admitted"] == s["served"] + s["dropped"] + s["queue_depth"] + s["in_flight"] + s["released"]
    r = LagQueue(mu=4, groups_per_update=2, max_groups=8)
    r.restore({"served": 2, "dropped": 1, "released": 3}, ["x", "y", "z"], [1, 1, 2])
    s = r.stats()
    assert s["put"] == 6 and s["in_flight"] == 0 and s["queue_depth"] == 3
    assert s["admitted"] == s["served"] + s["dropped"] + s["queue_depth"] + s["in_flight"] + s["released"]
    assert r.take(3) == (["x", "y"], [1, 1])


def test_metrics_sink_resumes_at_the_checkpoint_line_and_keeps_the_rest(tmp_path):
    sink = MetricsSink(tmp_path, tensorboard=False)
    for u in range(1, 6):
        sink.write({"kind": "update", "update": u})
    sink.close()
    sink = MetricsSink(tmp_path, tensorboard=False, keep_lines=3)  # checkpoint after update 3
    assert sink.lines == 3
    sink.write({"kind": "update", "update": 4})
    sink.close()
    assert [r["update"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    discarded = [json.loads(x)["update"] for x in (tmp_path / "metrics.discarded.jsonl").read_text().splitlines()]
    assert discarded == [4, 5]


def test_model_folder_check_names_the_folder_and_the_fault(tiny_model, tmp_path):
    import shutil

    from mugrpo_async.checkpoints.model_folder import ModelFolderError, check_model_folder

    check_model_folder(tiny_model)
    bad = tmp_path / "model"
    shutil.copytree(tiny_model, bad)
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelFolderError, match=r"model\.safetensors is truncated"):
        check_model_folder(bad)
    weights.write_bytes(b"not a safetensors file")
    with pytest.raises(ModelFolderError, match="not a safetensors file"):
        check_model_folder(bad)
    weights.write_bytes(data)
    (bad / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(ModelFolderError, match=f"{bad}: cannot be loaded"):
        check_model_folder(bad)
    weights.unlink()
    with pytest.raises(ModelFolderError, match="no \\*.safetensors"):
        check_model_folder(bad)
    (bad / "config.json").unlink()
    with pytest.raises(ModelFolderError, match="no config.json"):
        check_model_folder(bad)
