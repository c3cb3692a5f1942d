"""Integration: the trainer group on a simulated two-node Ray cluster with fake GPUs (CPU only, so gloo).

The head node (the driver's) and a second node at address 127.0.0.2 have two fake GPUs each; custom resources
pin ranks to either. Rank 0 on the second node and rank 1 on the head meet at rank 0's node address, not the
driver's; each sees its own GPU as ``CUDA_VISIBLE_DEVICES`` with ``LOCAL_RANK`` 0, and their update is one rank's
single pass. Two ranks on one node get distinct GPUs. A rank that fails to start stops the group, named.

.venv/bin/python -m pytest tests/test_trainer_group.py -q
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_config
from tests.test_trainer_dp import synthetic_groups

pytestmark = pytest.mark.slow

SECOND_NODE = "127.0.0.2"  # any loopback address reaches this machine
ON_HEAD = {"num_cpus": 1, "num_gpus": 1, "resources": {"head_node": 1}}
ON_SECOND = {"num_cpus": 1, "num_gpus": 1, "resources": {"second_node": 1}}


@pytest.fixture(scope="module")
def two_nodes():
    """Ray connected to a two-node cluster for this module; the session's local cluster is stopped meanwhile and
    started again afterwards as ``conftest.ray_cluster`` starts it (one driver connects to one cluster)."""
    import ray
    from ray.cluster_utils import Cluster

    session = ray.is_initialized()
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False,
                                                            "resources": {"head_node": 2}})  # fmt: skip
    cluster.add_node(num_cpus=2, num_gpus=2, resources={"second_node": 2}, node_ip_address=SECOND_NODE)
    ray.init(address=cluster.address, log_to_driver=False)
    yield ray
    ray.shutdown()
    cluster.shutdown()
    if session:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)


def _config(tiny_model, tmp_path, num_ranks: int, gpus: int, *more: str):
    overrides = [
        "trainer.lr=1e-3",
        "trainer.grad_clip=1e9",
        "schedule.groups_per_update=4",
        "trainer.micro_batch_size=8",
        f"trainer.num_ranks={num_ranks}",
        f"trainer.gpus_per_rank={gpus}",
    ]
    overrides += more
    return tiny_config(tiny_model, tmp_path, overrides)


def _update(ray, cfg, options: list[dict], groups) -> tuple[list[dict], dict, dict]:
    """Fresh ranks placed by ``options``: their device_info, the record and the weights of one update."""
    from drivers.trainer_group import start_trainer_group
    from mugrpo_async.reporting.metrics import update_record
    from mugrpo_async.training.weights import unpack_state_dict

    ranks = start_trainer_group(cfg, options)
    try:
        infos = ray.get([t.device_info.remote() for t in ranks])
        rec = update_record(ray.get([t.update_groups.remote(groups) for t in ranks]), update=1, policy_version=0)
        weights = unpack_state_dict(ray.get([t.export_weights.remote() for t in ranks])[0])
    finally:
        for t in ranks:
            ray.kill(t)
    return infos, rec, weights


def test_ranks_meet_on_rank_0s_node_and_update_as_one_pass(two_nodes, tiny_model, tmp_path):
    from transformers import AutoConfig

    groups = synthetic_groups(AutoConfig.from_pretrained(tiny_model).vocab_size, seed=2)
    cpu_only = {"num_cpus": 1, "resources": {"head_node": 1}}
    (one,), ref, w_ref = _update(two_nodes, _config(tiny_model, tmp_path, 1, 0), [cpu_only], groups)
    assert one["gpu_ids"] == [] and one["backend"] == "gloo" and one["device"] == "cpu"
    infos, rec, w = _update(two_nodes, _config(tiny_model, tmp_path, 2, 1), [ON_SECOND, ON_HEAD], groups)
    driver = two_nodes.util.get_node_ip_address()
    assert driver != SECOND_NODE and [i["node_ip"] for i in infos] == [SECOND_NODE, driver]
    (master,) = {tuple(i["master"]) for i in infos}  # every rank met at the same address
    assert master[0] == SECOND_NODE and master[1] > 0  # rank 0's node, where rank 0 found the port free
    for info in infos:  # Ray gave each rank one (fake) GPU and narrowed its visible devices to it
        assert len(info["gpu_ids"]) == 1 and info["cuda_visible_devices"] == info["gpu_ids"][0]
        assert info["local_rank"] == "0" and info["backend"] == "gloo" and info["engine_device"] == "cpu"
    assert rec["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    assert rec["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4) and ref["grad_norm"] > 0
    diff = torch.cat([(w[name] - t).abs().flatten() for name, t in w_ref.items()])
    assert float(diff.max()) <= 2.5e-3 and float((diff > 1e-5).float().mean()) < 1e-3  # see test_trainer_dp


def test_ranks_on_one_node_get_distinct_gpus(two_nodes, tiny_model, tmp_path):
    from drivers.trainer_group import start_trainer_group

    ranks = start_trainer_group(_config(tiny_model, tmp_path, 2, 1), [ON_SECOND, ON_SECOND])
    infos = two_nodes.get([t.device_info.remote() for t in ranks])
    for t in ranks:
        two_nodes.kill(t)
    assert sorted(i["gpu_ids"][0] for i in infos) == ["0", "1"]
    assert [i["cuda_visible_devices"] for i in infos] == [i["gpu_ids"][0] for i in infos]
    assert [i["local_rank"] for i in infos] == ["0", "0"] and {i["node_ip"] for i in infos} == {SECOND_NODE}


def test_a_rank_that_fails_to_start_stops_the_group(two_nodes, tiny_model, tmp_path):
    from drivers.stops import TrainerFailed
    from drivers.trainer_group import start_trainer_group

    cfg = _config(tiny_model, tmp_path, 2, 0, f"model.path={tmp_path / 'no-model'}")
    with pytest.raises(TrainerFailed, match=r"trainer rank [01] failed to start \(\w+Error: "):
        start_trainer_group(cfg, [{"num_cpus": 1}, {"num_cpus": 1}])
