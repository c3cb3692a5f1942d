"""The placement planner (pure): bundles and nodes of every actor, on described clusters; the dry run's placement."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mugrpo_async.config import ConfigError, load_config
from mugrpo_async.placement import Node, PlacementError, parse_cluster, plan_placement
from tests.conftest import REPO

GPU_CONFIGS = sorted((REPO / "configs" / "gpu").glob("*.yaml"))
PAPER = REPO / "configs" / "gpu" / "qwen3-8b-base-async.yaml"  # 4 engines + 4 ranks, 4 CPUs and 1 GPU each


def _paper(*overrides: str):
    return load_config(PAPER, list(overrides))


def _tiny(ranks: int, engines: int, tp: int = 1, rank_gpus: float = 1.0, engine_gpus: float = 1.0, cpus: float = 1.0):
    return load_config(None, [f"trainer.num_ranks={ranks}", f"rollout.num_workers={engines}",
                              f"rollout.tensor_parallel_size={tp}", f"trainer.gpus_per_rank={rank_gpus}",
                              f"rollout.gpus_per_worker={engine_gpus}", f"trainer.cpus_per_rank={cpus}",
                              f"rollout.cpus_per_worker={cpus}", "schedule.groups_per_update=24"])  # fmt: skip


def _nodes_of(slots) -> list[int]:
    return [s.node for s in slots]


def test_cluster_descriptions():
    assert parse_cluster("2x8") == (Node("node 0", 8), Node("node 1", 8))
    assert parse_cluster("8") == (Node("node 0", 8),)
    assert parse_cluster("2x8:64")[1] == Node("node 1", 8, 64.0)
    assert parse_cluster("8, 4:32") == (Node("node 0", 8), Node("node 1", 4, 32.0))
    assert math.isinf(parse_cluster("8")[0].cpus)
    for bad in ("", "x8", "2x", "0x8", "2x8x2", "eight", "8:", "2*8"):
        with pytest.raises(ValueError, match="not a cluster description"):
            parse_cluster(bad)


def test_paper_layout_on_one_8_gpu_node():
    p = plan_placement(_paper(), parse_cluster("8"))
    assert p.specs() == [{"CPU": 4.0, "GPU": 1.0}] * 8
    assert [s.bundles for s in p.trainers] == [(0,), (1,), (2,), (3,)]
    assert [s.bundles for s in p.engines] == [(4,), (5,), (6,), (7,)]
    assert {b.node for b in p.bundles} == {0} and p.trainer_nodes() == [0]


def test_two_8_gpu_nodes_pack_onto_the_first():
    p = plan_placement(_paper(), parse_cluster("2x8"))
    assert p.used_nodes() == [0] and _nodes_of(p.trainers) == [0] * 4 and _nodes_of(p.engines) == [0] * 4


def test_two_4_gpu_nodes_give_the_trainer_group_a_node_of_its_own():
    p = plan_placement(_paper(), parse_cluster("2x4"))
    assert _nodes_of(p.trainers) == [0] * 4 and _nodes_of(p.engines) == [1] * 4


@pytest.mark.parametrize("cluster, trainer_node, engine_node", [("8,4", 1, 0), ("4,8", 0, 1)])
def test_uneven_nodes_trainer_group_takes_the_best_fit(cluster, trainer_node, engine_node):
    p = plan_placement(_paper(), parse_cluster(cluster))
    assert _nodes_of(p.trainers) == [trainer_node] * 4 and _nodes_of(p.engines) == [engine_node] * 4


def test_layout_that_cannot_fit_names_the_keys():
    with pytest.raises(PlacementError) as err:
        plan_placement(_paper(), parse_cluster("2x2"))
    assert str(err.value) == (
        "the actors need 8 GPUs but the cluster has 4: lower rollout.num_workers / trainer.num_ranks or "
        "rollout.gpus_per_worker / trainer.gpus_per_rank (fractions share a device)"
    )
    with pytest.raises(PlacementError, match=r"the actors need 32 CPUs but the cluster has 16"):
        plan_placement(_paper(), parse_cluster("2x8:8"))
    with pytest.raises(PlacementError, match=r"^trainer.cpus_per_rank / trainer.gpus_per_rank: one rank needs 4 CPUs"):
        plan_placement(_paper(), parse_cluster("8x1:3,0:100"))
    with pytest.raises(PlacementError, match=r"^rollout.tensor_parallel_size / rollout.cpus_per_worker: one engine "):
        plan_placement(_tiny(1, 1, tp=4), parse_cluster("2x3"))
    with pytest.raises(PlacementError, match=r"lower rollout.num_workers x rollout.tensor_parallel_size / trainer"):
        plan_placement(_tiny(2, 2, tp=2), parse_cluster("5"))
    with pytest.raises(PlacementError, match="the cluster has no nodes"):
        plan_placement(_paper(), ())


def test_tensor_parallel_engines_take_k_bundles_of_one_node():
    p = plan_placement(_paper("rollout.tensor_parallel_size=2", "rollout.num_workers=2"), parse_cluster("2x4"))
    assert [s.bundles for s in p.engines] == [(4, 5), (6, 7)]
    assert p.specs()[4:] == [{"CPU": 4.0, "GPU": 1.0}, {"GPU": 1.0}] * 2  # the worker's CPUs in its first bundle
    assert all(len({p.bundles[b].node for b in s.bundles}) == 1 for s in p.engines)
    assert _nodes_of(p.trainers) == [0] * 4 and _nodes_of(p.engines) == [1, 1]
    # 3 + 3 GPUs: one TP=2 engine per node, so the two ranks straddle, one beside each engine.
    p = plan_placement(_tiny(2, 2, tp=2), parse_cluster("2x3"))
    assert _nodes_of(p.engines) == [0, 1] and _nodes_of(p.trainers) == [0, 1]


def test_fractional_gpus_share_devices_as_ray_counts_them():
    p = plan_placement(_tiny(2, 2, rank_gpus=0.5, engine_gpus=0.5), parse_cluster("2x2:8"))
    assert p.used_nodes() == [0]
    assert p.specs() == [{"CPU": 1.0, "GPU": 0.5}] * 4
    # 0.6 + 0.6 do not share one device: three such engines need three GPUs although 1.8 < 2.
    with pytest.raises(PlacementError, match="fit the cluster's totals but not its nodes"):
        plan_placement(_tiny(1, 3, rank_gpus=0.2, engine_gpus=0.6), parse_cluster("2"))
    p = plan_placement(_tiny(1, 2, rank_gpus=0.4, engine_gpus=0.6), parse_cluster("2"))
    assert p.used_nodes() == [0]  # the rank's 0.4 and one engine's 0.6 share a device, the other engine has one


def test_cpu_only_configs_place_on_cpus():
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml")
    p = plan_placement(cfg, (Node("node 0", 0, 4.0),))
    assert p.specs() == [{"CPU": 1.0}, {"CPU": 1.0}]
    with pytest.raises(PlacementError, match="the actors need 2 CPUs but the cluster has 1"):
        plan_placement(cfg, (Node("node 0", 0, 1.0),))


def _exists(ranks: int, engines: int, tp: int, gpus: list[int], one_node: bool) -> bool:
    """Brute force: some assignment of ranks and engines to nodes fits (with the trainer group on one node)."""
    n = len(gpus)
    for engine_nodes in itertools.product(range(n), repeat=engines):
        left = list(gpus)
        for j in engine_nodes:
            left[j] -= tp
        if min(left) < 0:
            continue
        if (max(left) if one_node else sum(left)) >= ranks:
            return True
    return False


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=1, max_size=3), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3))
def test_the_planner_finds_a_layout_when_one_exists_and_never_straddles_needlessly(gpus, ranks, engines, tp):
    """Whole GPUs, CPUs not counted: checked against every assignment of ranks and engines to nodes."""
    cfg = _tiny(ranks, engines, tp)
    nodes = tuple(Node(f"node {i}", g) for i, g in enumerate(gpus))
    if not _exists(ranks, engines, tp, gpus, one_node=False):
        with pytest.raises(PlacementError):
            plan_placement(cfg, nodes)
        return
    p = plan_placement(cfg, nodes)
    for j, node in enumerate(nodes):  # no node over its GPUs
        assert sum(b.gpus for b in p.bundles if b.node == j) <= node.gpus
    assert all(len({p.bundles[b].node for b in s.bundles}) == 1 for s in p.engines)
    straddles = len(p.trainer_nodes()) > 1
    assert not (straddles and _exists(ranks, engines, tp, gpus, one_node=True))
    trainer_nodes = _nodes_of(p.trainers)  # ranks grouped by node, rank 0 on the group's first node
    assert trainer_nodes == sorted(trainer_nodes, key=p.trainer_nodes().index)


def test_placement_keys_rules():
    cfg = load_config(None)
    assert (cfg.placement.mode, cfg.placement.timeout_s, cfg.rollout.tensor_parallel_size) == ("split", 300.0, 1)
    with pytest.raises(ConfigError, match=r"placement.mode: Input should be 'split' or 'colocated'"):
        load_config(None, ["placement.mode=spread"])
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size: 2 shards each engine .* must be > 0"):
        load_config(None, ["rollout.tensor_parallel_size=2"])
    for key in ("trainer.gpus_per_rank", "rollout.gpus_per_worker"):
        with pytest.raises(ConfigError, match=f"{key}: Input should be less than or equal to 1"):
            load_config(None, [f"{key}=2"])
    assert load_config(None, ["placement.timeout_s=5"]).resume_digest() == cfg.resume_digest()
    tp = load_config(None, ["rollout.tensor_parallel_size=2", "rollout.gpus_per_worker=1"])
    assert tp.resume_digest() == load_config(None, ["rollout.gpus_per_worker=1"]).resume_digest()


def _dry_run(capsys, *args: str) -> tuple[int, str, str]:
    from launch.train import main

    rc = main(["--dry-run", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("cluster", ["8", "2x8"])
@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_every_gpu_config_dry_runs_with_its_placement(capsys, monkeypatch, path, cluster):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rc, out, err = _dry_run(capsys, "--config", str(path), "--cluster", cluster)
    assert rc == 2 and err.startswith("error: invalid inputs: model.path")  # /models/... is not on this machine
    nodes = cluster.count("x") + 1
    if path.name.endswith("-async.yaml"):  # 4 engines + 4 ranks, a GPU each
        assert f"placement         split: 8 bundles in one placement group, on 1 of {nodes} node(s)" in out
        assert "  trainer rank 0  bundle 0 on node 0 (4 CPUs, 1 GPU); the group meets at this node's address" in out
        assert "  rollout worker 3 bundle 7 on node 0 (4 CPUs, 1 GPU)" in out and "rollout phase" not in out
    else:  # sync: 8 engines + 8 ranks, engine i and rank i sharing GPU i
        assert f"placement         colocated: 8 bundles in one placement group, on 1 of {nodes} node(s)" in out
        assert ("  trainer rank 7  bundle 7 on node 0 (8 CPUs, 1 GPU); device shared with rollout worker 7\n"
                "  rollout worker 0 bundle 0 on node 0 (8 CPUs, 1 GPU)\n") in out  # fmt: skip
        if path.name != "paper-common.yaml":  # a model whose sizes are known: memory per GPU in each phase
            assert "    rollout phase  engine weights " in out and "    training phase trainer weights " in out
    assert out.index("memory ") < out.index("placement ")  # after the plan, before the input check


def test_dry_run_refuses_what_cannot_fit_and_bad_descriptions(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rc, out, err = _dry_run(capsys, "--config", str(PAPER), "--cluster", "2x2")
    assert rc == 2 and err == ("error: the actors need 8 GPUs but the cluster has 4: lower rollout.num_workers / "
                               "trainer.num_ranks or rollout.gpus_per_worker / trainer.gpus_per_rank (fractions "
                               "share a device)\n")  # fmt: skip
    rc, out, err = _dry_run(capsys, "--config", str(PAPER), "--cluster", "two")
    assert rc == 2 and err.startswith("error: --cluster: 'two' is not a cluster description")
    tp = ("rollout.tensor_parallel_size=2", "rollout.num_workers=2")
    rc, out, err = _dry_run(capsys, "--config", str(PAPER), *tp, "--cluster", "2x4:16")
    assert rc == 2 and "  rollout worker 1 bundles 6-7 on node 1 (4 CPUs, 2 GPUs); tensor parallel 2" in out
    assert "rollout workers   2 x (4 CPU, 2 x 1 GPU), one vLLM engine each (tensor parallel 2)" in out
    from launch.train import main

    assert main(["--config", str(PAPER), "--cluster", "8"]) == 2
    assert "--cluster describes a cluster for --dry-run only" in capsys.readouterr().err


def test_dry_run_without_a_cluster_says_how_to_see_the_placement(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rc, out, _ = _dry_run(capsys, "--config", str(PAPER))
    assert "placement         pass --cluster NxG (or set RAY_ADDRESS)" in out and "bundle 0" not in out


def test_relative_run_folder_resolves_once_and_the_saved_config_says_so(tmp_path, monkeypatch):
    from drivers.run import resolve_run_folder
    from mugrpo_async.config import save_config

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["run.output_dir=runs/x"])
    notes = resolve_run_folder(cfg)
    assert cfg.run.output_dir == str(tmp_path / "runs" / "x")
    assert notes == [f"run.output_dir: runs/x resolved on the driver (in {tmp_path}) to {tmp_path / 'runs' / 'x'}"]
    assert resolve_run_folder(cfg) == [] and cfg.run.output_dir == str(tmp_path / "runs" / "x")
    save_config(cfg, tmp_path / "config.yaml", notes)
    text = (tmp_path / "config.yaml").read_text()
    assert text.startswith(f"# {notes[0]}\n") and load_config(tmp_path / "config.yaml") == cfg


def test_plan_memory_per_gpu_of_a_tensor_parallel_engine(tmp_path):
    from mugrpo_async.reporting.plan import build_plan, format_plan

    # The built-in table (28 heads, 4 KV heads); the split layout of 4 engines and 4 ranks.
    base = [f"model.path={tmp_path / 'Qwen2.5-Math-7B'}", "placement.mode=split", "rollout.num_workers=4",
            "rollout.gpus_per_worker=1", "trainer.num_ranks=4", "trainer.gpus_per_rank=1"]  # fmt: skip
    config = REPO / "configs" / "gpu" / "qwen2.5-math-7b-mu-grpo.yaml"
    text = {k: format_plan(build_plan(load_config(config, [*base, f"rollout.tensor_parallel_size={k}"])))
            for k in (1, 2, 8)}  # fmt: skip
    assert "rollout worker  weights 14.19 GiB, KV cache 56.00 GiB for 256 sequences" in text[1]
    assert "rollout worker  weights 7.09 GiB, KV cache 28.00 GiB" in text[2] and "per GPU of 2" in text[2]
    assert "1 x 4 CPU" not in text[2] and "4 x (4 CPU, 2 x 1 GPU)" in text[2]
    assert all("does not split" not in text[k] for k in (1, 2))
    assert "warning         rollout.tensor_parallel_size 8 does not split the model's 28 attention heads" in text[8]


# ---- colocated: engine i and trainer rank i share device i ------------------------------------------------------


def _colocated(ranks: int, engines: int, tp: int = 1, *more: str):
    return load_config(None, ["placement.mode=colocated", f"trainer.num_ranks={ranks}",
                              f"rollout.num_workers={engines}", f"rollout.tensor_parallel_size={tp}",
                              "trainer.gpus_per_rank=0.5",
                              "rollout.gpus_per_worker=0.5", "trainer.cpus_per_rank=1", "rollout.cpus_per_worker=1",
                              "schedule.groups_per_update=24", *more])  # fmt: skip


def test_colocated_engine_i_and_rank_i_share_bundle_i():
    p = plan_placement(_colocated(8, 8), parse_cluster("8"))
    assert p.specs() == [{"CPU": 2.0, "GPU": 1.0}] * 8  # one bundle per device: the rank's and the engine's shares
    assert [s.bundles for s in p.trainers] == [(i,) for i in range(8)]
    assert [s.bundles for s in p.engines] == [(i,) for i in range(8)]
    assert p.used_nodes() == [0]


def test_colocated_tensor_parallel_engine_spans_the_devices_of_k_ranks():
    p = plan_placement(_colocated(8, 4, 2), parse_cluster("2x4"))
    assert [s.bundles for s in p.engines] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert p.specs()[:2] == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]  # the engine's CPUs in its first
    assert _nodes_of(p.trainers) == [0] * 4 + [1] * 4 and _nodes_of(p.engines) == [0, 0, 1, 1]
    assert all(p.bundles[b].node == s.node for s in p.engines for b in s.bundles)
    # 3 + 3 GPUs: one TP=2 engine with its 2 ranks per node, never an engine across nodes.
    p = plan_placement(_colocated(4, 2, 2), parse_cluster("3,3"))
    assert _nodes_of(p.engines) == [0, 1] and _nodes_of(p.trainers) == [0, 0, 1, 1]
    # Fractional shares that sum below one reserve part of one device each.
    p = plan_placement(_colocated(2, 2, 1, "trainer.gpus_per_rank=0.3", "rollout.gpus_per_worker=0.4"),
                       parse_cluster("2"))  # fmt: skip
    assert p.specs() == [{"CPU": 2.0, "GPU": 0.7}] * 2 and p.used_nodes() == [0]
    with pytest.raises(PlacementError, match="need 1.4 GPUs and 4 CPUs but the cluster has 1 and 64"):
        plan_placement(_colocated(2, 2, 1, "trainer.gpus_per_rank=0.3", "rollout.gpus_per_worker=0.4"),
                       parse_cluster("1:64"))  # fmt: skip


def test_colocated_layouts_that_cannot_fit_name_the_keys():
    with pytest.raises(PlacementError, match=r"^placement.mode colocated: the 8 shared devices need 8 GPUs and 16 "):
        plan_placement(_colocated(8, 8), parse_cluster("2x2"))
    with pytest.raises(PlacementError, match=r"each engine needs rollout.tensor_parallel_size = 4 devices of one node"):
        plan_placement(_colocated(4, 1, 4), parse_cluster("2x2"))


def test_colocated_config_rules():
    with pytest.raises(ConfigError, match=r"placement.mode: colocated .* rollout.num_workers x "
                       r"rollout.tensor_parallel_size must equal trainer.num_ranks, got 4 x 1 and 8"):  # fmt: skip
        _colocated(8, 4)
    with pytest.raises(ConfigError, match=r"trainer.gpus_per_rank / rollout.gpus_per_worker: colocated actors share "
                       r"a GPU \(both > 0\) or run on CPUs \(both 0\), got 0.5 and 0"):  # fmt: skip
        _colocated(2, 2, 1, "rollout.gpus_per_worker=0")
    with pytest.raises(ConfigError, match=r"must sum to at most 1, got 0.5 \+ 0.6"):
        _colocated(2, 2, 1, "rollout.gpus_per_worker=0.6")
    with pytest.raises(ConfigError, match=r"schedule.mode async generates while it trains: use placement.mode split"):
        _colocated(2, 2, 1, "schedule.mode=async")
    cpu = load_config(REPO / "configs" / "tiny-cpu.yaml", ["placement.mode=colocated"])  # 1 engine + 1 rank on CPUs
    assert plan_placement(cpu, (Node("node 0", 0, 4.0),)).specs() == [{"CPU": 2.0}]
