"""GPU tier: the trainer on CUDA. Marked ``gpu`` and skipped without a CUDA device.

- `PolicyUpdater` over a plain CUDA model: every micro-batch and the reference model go to the GPU, and the update
  (plain, with the KL penalty, with M2PO's minibatch-wide mask) equals one pass over the minibatch on the CPU.
- One `TrainerRank` (Ray, ``num_gpus=1``, NCCL) with DeepSpeed ZeRO-2 and ZeRO-3 in bf16: it computes on the GPU
  Ray gave it, its log-probs at temperature 0.7 equal transformers' on the same weights, an update steps, and the
  exported weights are the full (gathered) bf16 tensors it holds.

On a GPU machine: ``python -m bench.gpu_check`` (runs these after its figures), or
``python -m pytest -q -m gpu tests/test_gpu.py``. The last test (not ``gpu``) runs ``bench.gpu_check --smoke``
on CPU, so that CI covers the check's code path.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench.gpu_check import SHAPES, build_qwen2_folder
from tests.conftest import REPO, tiny_config
from tests.test_trainer_dp import synthetic_groups

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (python -m bench.gpu_check)")
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    """A small Qwen2 (bf16 folder) whose logits are large enough for the temperature to matter."""
    folder = tmp_path_factory.mktemp("gpu-model")
    build_qwen2_folder(folder, SHAPES["smoke"], sharpen=8.0)
    return folder


def _reference_logprobs(folder, groups, dtype, temperature: float) -> list[list[float]]:
    """log softmax(logits / temperature) of every response token by plain transformers on the GPU, per row."""
    from transformers import AutoModelForCausalLM

    from mugrpo_async.training.batching import collate, flatten

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    rows = flatten(groups)
    b = collate(rows, pad_id=0).to("cuda")
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()  # (N, S, V)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    pos = (b.response_index - 1).clamp(min=0)  # (N, T)
    lp = logp.gather(1, pos.unsqueeze(-1).expand(-1, -1, logp.shape[-1]))
    lp = lp.gather(-1, b.input_ids.gather(1, b.response_index).unsqueeze(-1)).squeeze(-1).cpu()  # (N, T)
    return [lp[k, : len(g.responses[i])].tolist() for k, (g, i) in enumerate(rows)]


class _CudaEngine(torch.nn.Module):
    """The DeepSpeed engine's training interface over a plain CUDA model; records its inputs' devices."""

    def __init__(self, model, opt):
        super().__init__()
        self.module, self.opt, self.device, self.seen = model, opt, torch.device("cuda", 0), set()

    def forward(self, **kw):
        self.seen |= {str(v.device) for v in kw.values()}
        return self.module(**kw)

    def backward(self, loss, scale_wrt_gas):
        loss.backward()

    def step(self):
        pass

    def get_global_grad_norm(self):
        return 0.0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("algo", ["algo.kl_coef=0.0", "algo.kl_coef=0.1", "algo.name=m2po"])
def test_policy_updater_on_cuda_equals_one_pass_on_cpu(sharp_model, tmp_path, algo):
    from transformers import AutoModelForCausalLM

    from mugrpo_async.algo import policy_loss
    from mugrpo_async.training.batching import collate, flatten, token_logprobs
    from mugrpo_async.training.guard import NonFiniteGuard
    from mugrpo_async.training.update import PolicyUpdater

    groups = synthetic_groups(SHAPES["smoke"]["vocab_size"], num_groups=2)
    overrides = ["schedule.groups_per_update=2", "trainer.micro_batch_size=5", f"rollout.temperature={TEMPERATURE}"]
    cfg = tiny_config(sharp_model, tmp_path, [*overrides, algo])
    kl = cfg.algo.kl_coef > 0
    model = AutoModelForCausalLM.from_pretrained(sharp_model, dtype=torch.float32).cuda()
    ref = AutoModelForCausalLM.from_pretrained(sharp_model, dtype=torch.float32) if kl else None  # on the CPU
    engine = _CudaEngine(model, torch.optim.SGD(model.parameters(), lr=0.0))
    updater = PolicyUpdater(engine, cfg, 0, 1, NonFiniteGuard(engine.opt), ref)
    m = updater.update(groups)
    assert engine.seen == {"cuda:0"}
    assert ref is None or next(ref.parameters()).device.type == "cuda"
    cpu = AutoModelForCausalLM.from_pretrained(sharp_model, dtype=torch.float32)
    batch = collate(flatten(groups), pad_id=0)
    logp = token_logprobs(cpu, batch, TEMPERATURE)
    loss, _ = policy_loss(logp, batch.behavior_logprobs, batch.advantages, batch.response_mask, updater.spec,
                          ref_logprobs=logp.detach() if kl else None)  # fmt: skip
    assert m["loss"] == pytest.approx(float(loss.detach()), rel=1e-4, abs=1e-6)


def _start_rank(ray, folder, tmp_path, zero_stage: int):
    from drivers.trainer_group import start_trainer_group

    overrides = ["model.dtype=bfloat16", "trainer.gpus_per_rank=1", "trainer.micro_batch_size=64", "trainer.lr=1e-3",
                 f"rollout.temperature={TEMPERATURE}", "schedule.groups_per_update=4"]  # fmt: skip
    cfg = tiny_config(folder, tmp_path, [*overrides, f"trainer.zero_stage={zero_stage}"])
    (rank,) = start_trainer_group(cfg, [{"num_cpus": 1, "num_gpus": 1}])
    return rank


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_trainer_rank_on_cuda(ray_cluster, sharp_model, tmp_path, zero_stage):
    from transformers import AutoModelForCausalLM

    from mugrpo_async.training.weights import unpack_state_dict

    groups = synthetic_groups(SHAPES["smoke"]["vocab_size"], seed=4)
    rank = _start_rank(ray_cluster, sharp_model, tmp_path, zero_stage)
    try:
        info = ray_cluster.get(rank.device_info.remote())
        assert info["backend"] == "nccl" and info["device"] == "cuda:0" and info["engine_device"] == "cuda:0"
        assert info["local_rank"] == "0" and len(info["gpu_ids"]) == 1
        assert info["cuda_visible_devices"] == info["gpu_ids"][0]
        # Log-probs at the sampling temperature: the same bf16 weights and shapes as plain transformers.
        mine = [row for g in ray_cluster.get(rank.logprobs.remote(groups)) for row in g]
        want = _reference_logprobs(sharp_model, groups, torch.bfloat16, TEMPERATURE)
        at_one = _reference_logprobs(sharp_model, groups, torch.bfloat16, 1.0)
        gap = torch.tensor([abs(a - b) for x, y in zip(mine, want) for a, b in zip(x, y)])
        off = torch.tensor([abs(a - b) for x, y in zip(mine, at_one) for a, b in zip(x, y)])
        print(f"ZeRO-{zero_stage}: log-prob gap to transformers max {gap.max():.2e} mean {gap.mean():.2e}; "
              f"to temperature 1: mean {off.mean():.2e}")  # fmt: skip
        assert float(gap.max()) < 2e-2 and float(gap.mean()) < 2e-3
        assert float(off.mean()) > 50 * float(gap.mean()) + 0.05  # the temperature was applied
        m = ray_cluster.get(rank.update_groups.remote(groups))
        assert m["nonfinite_skipped"] == 0.0 and m["grad_norm"] > 0 and torch.isfinite(torch.tensor(m["loss"]))
        exported = unpack_state_dict(ray_cluster.get(rank.export_weights.remote()))
        held = ray_cluster.get(rank.full_state.remote())
        initial = dict(AutoModelForCausalLM.from_pretrained(sharp_model, dtype=torch.bfloat16).named_parameters())
        assert exported.keys() == held.keys() == initial.keys()
        for name, w in exported.items():  # full tensors (gathered under ZeRO-3), bf16, what the rank holds
            assert w.dtype == torch.bfloat16 and w.shape == initial[name].shape and torch.equal(w, held[name]), name
        assert any(not torch.equal(exported[k], initial[k]) for k in initial)  # the update stepped
        assert ray_cluster.get(rank.device_info.remote())["peak_device_memory_bytes"] > 0
    finally:
        ray_cluster.kill(rank)


@needs_cuda
@pytest.mark.gpu
def test_cuda_ipc_sync_reaches_another_process_of_the_gpu():
    """``cuda_ipc``'s protocol with CUDA IPC handles: a reader process opens every bucket of a 50M bf16 state staged
    on the GPU by this process, over three syncs, and finds every tensor's values (bench.ipc_check)."""
    from bench.ipc_check import measure_size

    r = measure_size(5e7, torch.device("cuda", 0), repeats=3, bucket_mb=16.0)
    assert r["bytes"] >= 1e8 and r["ipc_gbps"] > 0


@pytest.mark.slow
def test_gpu_check_smoke_runs_on_cpu(tmp_path):
    """``bench.gpu_check --smoke``: the check's code path end to end (on CPU here; the GPU tests then skip)."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["smoke"] and r["tokens_per_update"] == 8 * 64 and r["step_s"] > 0 and r["tokens_per_s"] > 0
    assert r["model"]["params"] > 0 and 0 < r["mfu"] < 1
    assert r["export"]["bytes"] >= 2 * r["model"]["params"] and r["export"]["gbps"] > 0  # bf16 weights
    gpu = torch.cuda.is_available()
    assert r["trainer"]["backend"] == ("nccl" if gpu else "gloo") and r["trainer"]["master"][1] > 0
    assert r["gpu_tests"]["returncode"] == 0 and ("passed" if gpu else "skipped") in r["gpu_tests"]["summary"]
    # cuda_ipc between two processes: every tensor checked by the reader (CUDA IPC on a GPU, shared memory here)
    assert r["ipc"] and all("error" not in v and v["ipc_gbps"] > 0 for v in r["ipc"].values()), r["ipc"]
