"""Sampling temperature on both sides: the engine's behaviour log-probs and the trainer's log-probs are those of
softmax(logits / T), the distribution that sampled the tokens, checked against a computation written here
(transformers forward on prompt + response, log_softmax(logits / T) at the sampled tokens)."""

from __future__ import annotations

import pytest
import torch

from mugrpo_async.rollout.samples import Group
from mugrpo_async.training.batching import collate, flatten, token_logprobs
from tests.conftest import tiny_config


def _reference(model, prompt_ids: list[int], response: list[int], temperature: float) -> list[float]:
    """log softmax(logits / T) of each response token given the prompt and the tokens before it (float64)."""
    ids = torch.tensor([list(prompt_ids) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()  # (P + R, V)
    p = len(prompt_ids)
    logp = torch.log_softmax(logits[p - 1 : p + len(response) - 1] / temperature, dim=-1)  # row j predicts token j
    return logp.gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1).tolist()


def _gaps(groups: list[Group], reference: list[list[list[float]]]) -> list[float]:
    return [
        abs(a - b)
        for g, ref in zip(groups, reference)
        for lps, ref_lps in zip(g.behavior_logprobs, ref)
        for a, b in zip(lps, ref_lps, strict=True)
    ]


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def _random_groups(vocab: int, seed: int = 0) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k, (p_len, r_lens) in enumerate([(5, [7, 1, 12]), (11, [3, 9, 4])]):
        prompt = torch.randint(2, vocab, (p_len,), generator=gen).tolist()
        responses = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in r_lens]
        out.append(Group(prompt_id=f"p{k}", prompt_ids=prompt, answer="1", responses=responses,
                         behavior_logprobs=[[0.0] * len(r) for r in responses], rewards=[1.0, 0.0, 0.0],
                         advantages=[1.0, -0.5, -0.5], policy_version=0, finish_reasons=["stop"] * 3))  # fmt: skip
    return out


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_token_logprobs_match_the_reference_at_the_sampling_temperature(hf_model, temperature):
    groups = _random_groups(hf_model.config.vocab_size)
    rows = flatten(groups)
    with torch.no_grad():
        got = token_logprobs(hf_model, collate(rows, pad_id=0), temperature)  # (N, T), padded batch
    for k, (g, i) in enumerate(rows):
        want = _reference(hf_model, g.prompt_ids, g.responses[i], temperature)
        assert got[k, : len(want)].tolist() == pytest.approx(want, abs=1e-4)
        assert got[k, len(want) :].abs().sum() == 0  # padding
        if temperature != 1.0:  # the temperature matters: T = 1 log-probs of the same tokens differ
            raw = _reference(hf_model, g.prompt_ids, g.responses[i], 1.0)
            assert max(abs(a - b) for a, b in zip(raw, want)) > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_engine_behaviour_logprobs_are_the_sampling_distributions(ray_cluster, tiny_model, hf_model, temperature):
    from transformers import AutoTokenizer

    from actors.rollout import RolloutWorker, engine_env
    from mugrpo_async.data.pool import synthetic_prompts

    cfg = tiny_config(tiny_model, None, [f"rollout.temperature={temperature}", "rollout.max_new_tokens=12"])
    worker = RolloutWorker.options(num_cpus=1, runtime_env={"env_vars": engine_env(cfg)}).remote(cfg.to_dict(), 0)
    try:
        prompts = synthetic_prompts(cfg, AutoTokenizer.from_pretrained(tiny_model))[0][:6]
        groups = ray_cluster.get(worker.generate.remote(prompts))["groups"]
    finally:
        ray_cluster.kill(worker)
    at_t = [[_reference(hf_model, g.prompt_ids, r, temperature) for r in g.responses] for g in groups]
    at_1 = [[_reference(hf_model, g.prompt_ids, r, 1.0) for r in g.responses] for g in groups]
    gaps, raw_gaps = _gaps(groups, at_t), _gaps(groups, at_1)
    print(f"T={temperature}: {len(gaps)} tokens, engine vs reference max {max(gaps):.1e}; "
          f"vs T=1 log-probs mean {sum(raw_gaps) / len(raw_gaps):.3f} max {max(raw_gaps):.3f}")  # fmt: skip
    assert len(gaps) >= 50 and max(gaps) < 1e-3
    # Raw (T = 1) log-probs of the same tokens are far from them: with those the assertion above would fail.
    assert max(raw_gaps) > 0.1 and sum(raw_gaps) / len(raw_gaps) > 0.01
