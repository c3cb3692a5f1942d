"""Chunked log-probs equal the unchunked path: values, entropies and every parameter's gradient, at several
temperatures and chunk sizes, through the custom autograd function and the checkpointed (ZeRO-3) variant.

.venv/bin/python -m pytest tests/test_logprobs_chunked.py -q
"""

from __future__ import annotations

import random

import pytest
import torch

from mugrpo_async.rollout.samples import Group
from mugrpo_async.training.batching import collate, flatten, packed_inputs, token_logprobs
from mugrpo_async.training.logprobs import ChunkedHeadLogprobs, _checkpointed, token_scores


def _groups(vocab: int, seed: int = 0) -> list[Group]:
    rng = random.Random(seed)
    out = []
    for k in range(3):
        lengths = [rng.randint(1, 9) for _ in range(4)]
        out.append(Group(
            prompt_id=f"p{k}", prompt_ids=[rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))], answer="0",
            responses=[[rng.randrange(3, vocab) for _ in range(n)] for n in lengths],
            behavior_logprobs=[[-1.0] * n for n in lengths], rewards=[0.0, 1.0, 0.0, 1.0],
            advantages=[-1.0, 1.0, -1.0, 1.0], policy_version=0, finish_reasons=["stop"] * 4,
        ))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def _grads(model, logp: torch.Tensor, batch) -> dict[str, torch.Tensor]:
    model.zero_grad()
    weights = torch.linspace(-1.0, 2.0, logp.numel()).view_as(logp)  # a loss that weighs every token differently
    (logp * weights * batch.response_mask).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_values_and_gradients_equal_the_unchunked_path(hf_model, temperature, chunk):
    batch = collate(flatten(_groups(hf_model.config.vocab_size)), pad_id=0)
    ref = token_logprobs(hf_model, batch, temperature)
    g_ref = _grads(hf_model, ref, batch)
    logp, ent = token_scores(hf_model, batch, temperature, chunk_tokens=chunk)
    assert not ent.requires_grad and torch.equal(logp == 0, ~batch.response_mask | (logp == 0))
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)
    g = _grads(hf_model, logp, batch)
    assert set(g) == set(g_ref)
    for name, want in g_ref.items():  # float32 sums in another order: equal to 1e-4 of each tensor's norm
        gap = float((g[name] - want).norm() / want.norm())  # the key projections' (small, cancelling sums) reach 1e-5
        assert gap < 1e-4, (name, gap)  # on some CPUs and builds; a wrong gradient is off by order 1
    # Entropy by hand from the full distribution, and the unchunked path's own entropies.
    un_logp, un_ent = token_scores(hf_model, batch, temperature, chunk_tokens=0)
    torch.testing.assert_close(un_logp, ref)
    torch.testing.assert_close(ent, un_ent, rtol=1e-5, atol=1e-5)
    assert float(ent[batch.response_mask].min()) > 0 and float(ent[~batch.response_mask].abs().max()) == 0


def test_head_function_and_checkpointed_head_match_a_dense_softmax():
    """The autograd function (with a bias) and the checkpointed module against log_softmax over all rows at once."""
    torch.manual_seed(0)
    n, h_size, v, t = 11, 6, 50, 0.8
    head = torch.nn.Linear(h_size, v, bias=True).double()
    hidden = torch.randn(n, h_size, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    g_out = torch.randn(n, dtype=torch.float64)
    logpi = torch.log_softmax(head(hidden) / t, dim=-1)
    want = logpi.gather(-1, targets[:, None])[:, 0]
    want_ent = -(logpi.exp() * logpi).sum(-1)
    want_grads = torch.autograd.grad((want * g_out).sum(), [hidden, head.weight, head.bias])
    for run in (lambda: ChunkedHeadLogprobs.apply(hidden, head.weight, head.bias, targets, t, 4),
                lambda: _checkpointed(head, hidden, targets, t, 4)):  # fmt: skip
        logp, ent = run()
        torch.testing.assert_close(logp.double(), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ent.double(), want_ent.detach(), rtol=1e-6, atol=1e-6)
        grads = torch.autograd.grad((logp.double() * g_out).sum(), [hidden, head.weight, head.bias])
        for got, exp in zip(grads, want_grads):
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-7)


def test_a_soft_capped_head_is_refused_with_the_key(hf_model):
    batch = collate(flatten(_groups(hf_model.config.vocab_size)), pad_id=0)
    hf_model.config.final_logit_softcapping = 30.0
    try:
        with pytest.raises(ValueError, match="trainer.logprob_chunk_tokens"):
            token_scores(hf_model, batch, 1.0, chunk_tokens=8)
    finally:
        hf_model.config.final_logit_softcapping = None


def test_response_logprobs_in_chunks_equal_the_whole_batch(hf_model):
    """The trainer's behaviour log-probs (truncated IS, `PolicyUpdater.logprobs`) take the update's chunks."""
    from mugrpo_async.training.batching import response_logprobs

    groups = _groups(hf_model.config.vocab_size)
    whole = response_logprobs(hf_model, groups, 3, 0.7)
    chunked = response_logprobs(hf_model, groups, 3, 0.7, chunk_tokens=5)
    assert [len(r) for g in chunked for r in g] == [len(r) for g in whole for r in g]
    for a, b in zip(whole, chunked):
        for ra, rb in zip(a, b):
            assert rb == pytest.approx(ra, abs=1e-5)


@pytest.mark.parametrize("attn,chunk", [("sdpa", 5), ("eager", 0)])
def test_padding_free_packing_gives_the_padded_values_and_gradients(tiny_model, attn, chunk):
    """The rows packed into one sequence (position ids restarting per row, no padding and no attention mask):
    transformers keeps the packed rows apart, so log-probs, entropies and gradients are the padded batch's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=attn)
    batch = collate(flatten(_groups(model.config.vocab_size, seed=3)), pad_id=0)
    assert (batch.attention_mask == 0).any()  # the padded batch has padding to drop
    ref, ref_ent = token_scores(model, batch, 0.8, chunk_tokens=chunk)
    g_ref = _grads(model, ref, batch)
    logp, ent = token_scores(model, batch, 0.8, chunk_tokens=chunk, packed=True)
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    g = _grads(model, logp, batch)
    for name, want in g_ref.items():
        assert float((g[name] - want).norm() / want.norm()) < 1e-5, name
    inputs = packed_inputs(batch)[0]
    with torch.no_grad():  # the same packed tokens without their position ids: the rows would see each other
        leaky = model(input_ids=inputs["input_ids"]).logits[0]
        apart = model(**inputs).logits[0]
    assert not torch.allclose(leaky, apart, atol=1e-4)  # so the equalities above test the packing
