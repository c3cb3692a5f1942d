"""Token-budget micro-batches: the packing rule, the balance over ranks, equal micro-batch counts on every rank,
and one update through them (chunked log-probs too) giving the weights of one pass over the minibatch.

.venv/bin/python -m pytest tests/test_token_budget.py -q
"""

from __future__ import annotations

import random

import pytest
import torch

from mugrpo_async.rollout.samples import Group
from mugrpo_async.training.batching import collate, flatten
from mugrpo_async.training.guard import NonFiniteGuard
from mugrpo_async.training.minibatch import (
    balanced_rank_rows,
    equalise,
    rank_share,
    token_bounds,
    token_micro_batches,
)


def _groups(num: int = 6, g: int = 4, seed: int = 0, vocab: int = 40) -> list[Group]:
    rng = random.Random(seed)
    out = []
    for k in range(num):
        lengths = [rng.choice([1, 2, 3, 4, 30]) for _ in range(g)]  # long-tailed
        rewards = [float(i % 2) for i in range(g)]
        out.append(Group(
            prompt_id=f"p{k}", prompt_ids=[rng.randrange(3, vocab) for _ in range(rng.randint(2, 5))], answer="0",
            responses=[[rng.randrange(3, vocab) for _ in range(n)] for n in lengths],
            behavior_logprobs=[[-rng.uniform(2.0, 5.0) for _ in range(n)] for n in lengths], rewards=rewards,
            advantages=[r - 0.5 for r in rewards], policy_version=0, finish_reasons=["stop"] * g,
        ))  # fmt: skip
    return out


def test_token_bounds_pack_greedily_within_the_budget():
    assert token_bounds([2, 3, 3, 5, 9, 20], 10) == [(0, 3), (3, 4), (4, 5), (5, 6)]
    assert token_bounds([1, 1, 1, 1], 100) == [(0, 4)]
    assert token_bounds([], 10) == []
    lengths = sorted(random.Random(1).choices(range(1, 50), k=200))
    for a, b in token_bounds(lengths, 120):
        assert (b - a) * lengths[b - 1] <= 120 or b - a == 1
    assert token_bounds([2, 3, 3, 5, 9, 20], 10, packed=True) == [(0, 3), (3, 4), (4, 5), (5, 6)]
    assert token_bounds([1, 2, 3, 4, 9], 10, packed=True) == [(0, 4), (4, 5)]  # 10 real tokens; padded: 16
    for a, b in token_bounds(lengths, 120, packed=True):
        assert sum(lengths[a:b]) <= 120 or b - a == 1


def test_equalise_splits_the_largest_then_pads():
    lengths = [1, 2, 2, 2, 8, 8]
    assert equalise([(0, 4), (4, 6)], lengths, 3) == [(0, 4), (4, 5), (5, 6)]  # 2 x 8 = 16 > 4 x 2
    assert equalise([(0, 1), (1, 2)], lengths, 4) == [(0, 1), (1, 2), (0, 0), (0, 0)]  # single rows: padding


def test_ranks_balance_tokens_and_agree_on_the_count():
    groups = _groups(num=8)
    shares = balanced_rank_rows(groups, 3)
    assert sorted(id(g) * 100 + i for s in shares for g, i in s) == sorted(id(g) * 100 + i for g, i in flatten(groups))
    tokens = [sum(len(g.prompt_ids) + len(g.responses[i]) for g, i in s) for s in shares]
    longest = max(len(g.prompt_ids) + len(r) for g in groups for r in g.responses)
    assert max(tokens) - min(tokens) <= longest
    per_rank = [rank_share(groups, r, 3, False, max_tokens=40) for r in range(3)]
    counts = {s.num_micro for s in per_rank}
    assert len(counts) == 1 and counts.pop() >= 2
    for s in per_rank:
        micro = token_micro_batches(s.batch, 40, s.num_micro)
        assert len(micro) == s.num_micro
        real = [mb for mb in micro if mb.response_mask.any()]
        assert sum(int(mb.response_mask.sum()) for mb in micro) == int(s.batch.response_mask.sum())
        assert all(mb.input_ids.numel() <= 40 or len(mb) == 1 for mb in real)


class _Engine(torch.nn.Module):
    """A plain model and optimizer behind the engine interface; steps at the boundary it is told of."""

    def __init__(self, model, opt):
        super().__init__()
        self.module, self.opt, self.boundary, self.steps, self.backwards = model, opt, False, 0, 0

    def forward(self, **kw):
        return self.module(**kw)

    def set_gradient_accumulation_boundary(self, is_boundary: bool):
        self.boundary = is_boundary

    def backward(self, loss, scale_wrt_gas):
        self.backwards += 1
        loss.backward()

    def step(self):
        if self.boundary:
            self.steps += 1
            self.opt.step()
            self.opt.zero_grad()

    def get_global_grad_norm(self):
        return 0.0


@pytest.mark.parametrize("chunk,packed", [(0, False), (3, False), (3, True)])
def test_an_update_in_token_budget_micro_batches_equals_one_pass(tiny_model, chunk, packed):
    from transformers import AutoModelForCausalLM

    from mugrpo_async.algo import policy_loss
    from mugrpo_async.config import load_config
    from mugrpo_async.reporting.metrics import update_record
    from mugrpo_async.training.batching import token_logprobs
    from mugrpo_async.training.update import PolicyUpdater

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    groups = _groups(num=2, vocab=model.config.vocab_size)
    cfg = load_config(None, [f"model.path={tiny_model}", "rollout.group_size=4", "schedule.groups_per_update=2",
                             "trainer.max_tokens_per_micro_batch=24", f"trainer.logprob_chunk_tokens={chunk}",
                             "rollout.temperature=0.7", f"trainer.padding_free={packed}"])  # fmt: skip
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = _Engine(model, opt)
    m = PolicyUpdater(engine, cfg, 0, 1, NonFiniteGuard(opt)).update(groups)
    assert engine.steps == 1 and engine.backwards == m["num_micro_batches"] >= 3
    batch = collate(flatten(groups), pad_id=0)
    mu_grpo = {"clip_low": 0.0, "clip_high": 5.0, "nav_tau": 1e-4, "nav_scope": "sequence"}
    loss, _ = policy_loss(token_logprobs(reference, batch, 0.7), batch.behavior_logprobs, batch.advantages,
                          batch.response_mask, **mu_grpo)  # fmt: skip
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-5)
    gap = max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), reference.parameters()))
    assert gap < 1e-5
    rec = update_record([m], update=1, policy_version=0)
    assert 0.0 < rec["entropy_mean"] < float(torch.log(torch.tensor(model.config.vocab_size)))


def test_dry_run_memory_formulas_by_hand():
    """The plan's host and logits estimates for the paper's Qwen3-8B config, counted by hand."""
    from mugrpo_async.config import load_config
    from mugrpo_async.reporting.plan import host_memory, logits_peak, resolve_architecture
    from tests.conftest import REPO

    cfg = load_config(REPO / "configs" / "gpu" / "qwen3-8b-base-mu-grpo.yaml", [])
    arch, _, _ = resolve_architecture(cfg.model.path)
    assert (arch.vocab_size, arch.hidden_size) == (151_936, 4096)
    per_group = 8 * 8192 + 1024  # G x max_new_tokens + max_prompt_tokens
    chunk = 256 * per_group  # chunk_tokens 2^24 // (8 x 8192) = 256 groups per call
    index = 700 * 32 * 1024  # the stage's index: B_train groups
    assert host_memory(cfg) == {
        "driver": 2 * index + 3 * 8 * chunk,
        "trainer_rank": index + 8 * 32 * per_group + 29 * 32 * 8 * 9216,
        "engine_actor": 8 * chunk,
    }
    tis = load_config(REPO / "configs" / "gpu" / "qwen3-8b-base-mu-grpo.yaml", ["algo.tis_cap=2.0"])
    assert host_memory(tis)["trainer_rank"] - host_memory(cfg)["trainer_rank"] == 4 * 32 * 1024 * 8 * 8192
    assert logits_peak(cfg, arch) == 3 * 1024 * 151_936 * 4 + 8192 * 4096 * 2
    rows = load_config(REPO / "configs" / "gpu" / "qwen3-8b-base-mu-grpo.yaml",
                       ["trainer.logprob_chunk_tokens=0", "trainer.max_tokens_per_micro_batch=0"])  # fmt: skip
    assert logits_peak(rows, arch) == 9216 * 151_936 * 2 + 4 * 8192 * 151_936 * 4
