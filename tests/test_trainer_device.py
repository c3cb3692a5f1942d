"""Unit tests of where a trainer rank computes (no Ray started, no DeepSpeed): its device, LOCAL_RANK and backend
from the GPUs Ray assigned it, batches moved to the engine's device, ranks sharing a GPU refused.

.venv/bin/python -m pytest tests/test_trainer_device.py -q
"""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch

from mugrpo_async.rollout.samples import Group
from mugrpo_async.training.batching import Batch, collate, flatten
from mugrpo_async.training.distributed import RankDevice, free_port, rank_device, rank_env


def _group(k: int, lengths: list[int]) -> Group:
    rewards = [float(j % 2) for j in range(len(lengths))]
    return Group(
        prompt_id=f"p{k}", prompt_ids=[3, 4, 5][: 1 + k % 3], answer="1",
        responses=[[6 + j] * n for j, n in enumerate(lengths)],
        behavior_logprobs=[[-0.5 * (j + 1)] * n for j, n in enumerate(lengths)], rewards=rewards,
        advantages=[r - sum(rewards) / len(rewards) for r in rewards], policy_version=0,
        finish_reasons=["stop"] * len(lengths),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("gpu_ids", "visible", "cuda", "want"),
    [
        ([], None, False, RankDevice(0, "gloo", "cpu")),
        ([], "0,1", True, RankDevice(0, "gloo", "cpu")),  # a CPU rank on a GPU node stays on the CPU
        ([1], "1", False, RankDevice(0, "gloo", "cpu", ("1",))),  # fake GPUs on a CPU-only cluster
        ([3], "3", True, RankDevice(0, "nccl", "cuda:0", ("3",))),  # Ray narrowed the visible devices
        (["2"], None, True, RankDevice(2, "nccl", "cuda:2", ("2",))),  # RAY_EXPERIMENTAL_NOSET_...: all visible
        ([2], "0,1,2,3", True, RankDevice(2, "nccl", "cuda:2", ("2",))),
        (["GPU-ab"], "GPU-ab", True, RankDevice(0, "nccl", "cuda:0", ("GPU-ab",))),  # ids given as UUIDs
    ],
)
def test_a_rank_computes_on_the_gpu_ray_assigned_it(gpu_ids, visible, cuda, want):
    assert rank_device(gpu_ids, visible, cuda) == want


def test_a_gpu_that_is_not_visible_is_an_error():
    with pytest.raises(RuntimeError, match="GPU 5 assigned by Ray is not among CUDA_VISIBLE_DEVICES='0,1'"):
        rank_device([5], "0,1", True)


def test_local_rank_is_the_device_index_not_the_global_rank():
    env = rank_env(3, 4, rank_device([3], "3", True))
    assert env == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "DS_ACCELERATOR": "cuda"}
    assert rank_env(1, 2, rank_device([1], "1", False))["DS_ACCELERATOR"] == "cpu"


def test_free_port_can_be_bound_on_every_interface():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("", port))


def test_batch_to_moves_every_tensor():
    rows = flatten([_group(0, [2, 3]), _group(1, [4, 1])])
    batch = collate(rows, pad_id=0, row_logprobs=[[-1.0] * len(g.responses[i]) for g, i in rows])
    moved = batch.to("meta")
    for f in dataclasses.fields(Batch):
        before, after = getattr(batch, f.name), getattr(moved, f.name)
        assert after.device.type == "meta" and after.shape == before.shape and after.dtype == before.dtype, f.name
    assert batch.to("cpu") is batch and collate(rows, pad_id=0).to("meta").trainer_behavior_logprobs is None


class _RecordingEngine(torch.nn.Module):
    """The engine's training interface over a CPU model, claiming to compute on ``device``: its forward accepts
    only tensors that the updater sent there (through `Batch.to`, recorded by the test)."""

    def __init__(self, model, device: torch.device, sent: set[int]):
        super().__init__()
        self.module, self.device, self.sent, self.calls = model, device, sent, 0

    def forward(self, input_ids, attention_mask):
        assert id(input_ids) in self.sent and id(attention_mask) in self.sent, "a batch that was not moved"
        return self.module(input_ids=input_ids, attention_mask=attention_mask)

    def backward(self, loss, scale_wrt_gas):
        loss.backward()

    def step(self):
        self.calls += 1

    def get_global_grad_norm(self):
        return 0.0


def test_policy_updater_sends_every_micro_batch_to_the_engine_device(tiny_model, monkeypatch):
    """The engine says it computes on ``meta``: every micro-batch of an update and of a log-prob pass must be sent
    there before the forward pass. The math itself runs on the CPU (a tensor on ``meta`` holds no values): the
    recorded move hands back fresh CPU copies, and only those are accepted by the engine."""
    from transformers import AutoModelForCausalLM

    from mugrpo_async.config import load_config
    from mugrpo_async.training.guard import NonFiniteGuard
    from mugrpo_async.training.update import PolicyUpdater

    targets, sent = [], set()
    host_to = Batch.to

    def recorded_to(self, device):
        targets.append(torch.device(device))
        copy = host_to(self, "cpu")
        copy = Batch(**{f.name: None if (t := getattr(copy, f.name)) is None else t.clone()
                        for f in dataclasses.fields(Batch)})  # fmt: skip
        sent.update(id(getattr(copy, f.name)) for f in dataclasses.fields(Batch))
        return copy

    monkeypatch.setattr(Batch, "to", recorded_to)
    cfg = load_config(None, [f"model.path={tiny_model}", "rollout.group_size=2", "schedule.groups_per_update=2",
                             "trainer.micro_batch_size=3"])  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = _RecordingEngine(model, torch.device("meta"), sent)
    updater = PolicyUpdater(engine, cfg, 0, 1, NonFiniteGuard(opt))
    assert updater.device == torch.device("meta")
    groups = [_group(0, [3, 4]), _group(1, [2, 5])]
    m = updater.update(groups)
    assert engine.calls == 2 and targets == [torch.device("meta")] * 2 and m["num_tokens"] == 14
    assert len(updater.logprobs(groups)) == 2 and targets[2:] == [torch.device("meta")] * 2


def test_ranks_sharing_a_gpu_under_nccl_are_refused():
    from drivers.trainer_group import shared_gpus

    def info(rank, node, gpu, backend="nccl"):
        return {"rank": rank, "node_ip": node, "gpu_ids": [gpu], "backend": backend}

    assert shared_gpus([info(0, "10.0.0.1", "0"), info(1, "10.0.0.1", "1"), info(2, "10.0.0.2", "0")]) == []
    assert shared_gpus([info(0, "n", "0", "gloo"), info(1, "n", "0", "gloo")]) == []  # fake GPUs on CPU
    (problem,) = shared_gpus([info(0, "10.0.0.1", "0"), info(1, "10.0.0.2", "0"), info(2, "10.0.0.1", "0")])
    assert problem.startswith("trainer ranks 0 and 2 share GPU 0 of node 10.0.0.1")
