"""Unit tests of the trainer's pure parts (no Ray, no DeepSpeed): minibatch shares and totals, the equal-reward drop,
M2PO's minibatch-wide mask cut into micro-batches, the idle clock, the non-finite guard, strided sharing.

.venv/bin/python -m pytest tests/test_training_lib.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from mugrpo_async.algo import m2po_mask
from mugrpo_async.rollout.samples import Group
from mugrpo_async.training.batching import collate, flatten
from mugrpo_async.training.distributed import all_ranks_agree, gather_objects, strided_share, unstride
from mugrpo_async.training.guard import NonFiniteGuard, grads_finite, params_finite
from mugrpo_async.training.idle import IdleClock
from mugrpo_async.training.minibatch import m2po_micro_keeps, micro_batches, rank_rows, rank_share, token_log_ratios


def _group(k: int, rewards: list[float], lengths: list[int], version: int = 0) -> Group:
    return Group(
        prompt_id=f"p{k}", prompt_ids=[1, 2, 3][: 1 + k % 3], answer="1",
        responses=[[5 + j] * n for j, n in enumerate(lengths)],
        behavior_logprobs=[[-0.1 * (j + 1)] * n for j, n in enumerate(lengths)], rewards=rewards,
        advantages=[r - sum(rewards) / len(rewards) for r in rewards], policy_version=version,
        finish_reasons=["stop"] * len(lengths),
    )  # fmt: skip


GROUPS = [
    _group(0, [1.0, 0.0], [3, 5]),
    _group(1, [1.0, 1.0], [2, 4]),  # equal rewards
    _group(2, [0.0, 1.0], [6, 1]),
    _group(3, [0.0, 0.0], [2, 2]),  # equal rewards
]


def test_rank_rows_are_contiguous_shares_ordered_by_length():
    rows = flatten(GROUPS)
    shares = [rank_rows(GROUPS, r, 2) for r in range(2)]
    assert sorted(map(id, [g for s in shares for g, _ in s])) == sorted(map(id, [g for g, _ in rows]))
    assert {(g.prompt_id, i) for g, i in shares[0]} == {(g.prompt_id, i) for g, i in rows[:4]}
    lengths = [len(g.prompt_ids) + len(g.responses[i]) for g, i in shares[1]]
    assert lengths == sorted(lengths)
    with pytest.raises(ValueError, match="do not split evenly"):
        rank_rows(GROUPS, 0, 3)


def test_totals_span_the_whole_minibatch_and_the_drop_removes_equal_reward_groups():
    share = rank_share(GROUPS, 1, 2, drop_equal_reward_groups=False)
    assert share.totals == {"num_sequences": 8, "num_tokens": 3 + 5 + 2 + 4 + 6 + 1 + 2 + 2}
    assert share.groups_dropped == 0 and len(share.batch) == 4
    dropped = rank_share(GROUPS, 1, 2, drop_equal_reward_groups=True)
    assert dropped.totals == {"num_sequences": 4, "num_tokens": 3 + 5 + 6 + 1} and dropped.groups_dropped == 2
    # Rank 1 holds groups 2 and 3: group 3's rows keep their place but lose every response token.
    live = dropped.batch.response_mask.sum(dim=1).tolist()
    assert sorted(live) == [0, 0, 1, 6]


def test_micro_batches_cover_every_row_once():
    batch = collate(flatten(GROUPS), pad_id=0)
    parts = micro_batches(batch, 3)
    assert [len(p) for p in parts] == [3, 3, 2]
    assert torch.equal(torch.cat([p.advantages for p in parts]), batch.advantages)
    assert parts[2].response_mask.shape[1] == max(len(r) for g in GROUPS[3:] for r in g.responses[:2])


def test_trainer_logprobs_follow_their_rows():
    old = [[[-0.5 - k] * len(r) for r in g.responses] for k, g in enumerate(GROUPS)]
    share = rank_share(GROUPS, 0, 2, False, old)
    b = share.batch
    for row in range(len(b)):
        n = int(b.response_mask[row].sum())
        vals = set(b.trainer_behavior_logprobs[row, :n].tolist())
        assert len(vals) == 1 and vals.pop() in (-0.5, -1.5)  # rank 0 holds groups 0 and 1
    ratios = token_log_ratios(torch.zeros_like(b.behavior_logprobs), b)
    assert torch.equal(ratios, -b.trainer_behavior_logprobs[b.response_mask])


def test_m2po_mask_cut_into_micro_batches_equals_one_pass():
    torch.manual_seed(0)
    batch = collate(flatten(GROUPS), pad_id=0)
    log_ratio = torch.randn(batch.response_mask.shape) * batch.response_mask
    full = m2po_mask(log_ratio, batch.response_mask, 0.04)
    parts, ratios, rows = micro_batches(batch, 3), [], 0
    for p in parts:
        ratios.append(log_ratio[rows : rows + len(p), : p.response_mask.shape[1]][p.response_mask])
        rows += len(p)
    # Two "ranks": this rank's tokens and another rank's, gathered in rank order.
    other = torch.tensor([0.05, -0.01, 3.0])
    keeps = m2po_micro_keeps(ratios, parts, [other, torch.cat(ratios)], 1, 0.04)
    everything = torch.cat([other, torch.cat(ratios)]).view(1, -1)
    expected = m2po_mask(everything, torch.ones_like(everything, dtype=torch.bool), 0.04)[0][3:]
    assert torch.equal(torch.cat([k[p.response_mask] for k, p in zip(keeps, parts)]), expected)
    alone = m2po_micro_keeps(ratios, parts, [torch.cat(ratios)], 0, 0.04)
    assert torch.equal(torch.cat([k[p.response_mask] for k, p in zip(alone, parts)]), full[batch.response_mask])


def test_idle_clock_accounts_waits_and_steps():
    now = [10.0]
    clock = IdleClock(lambda: now[0])
    now[0] = 12.0
    assert clock.begin_step() == 2.0
    now[0] = 15.0
    assert clock.end_step() == 3.0
    now[0] = 16.0
    clock.begin_step()
    now[0] = 20.0
    clock.end_step()
    assert (clock.cum_wait, clock.cum_busy) == (3.0, 7.0) and clock.idle_ratio == pytest.approx(0.3)
    restored = IdleClock(lambda: now[0])
    restored.load(clock.state())
    now[0] = 21.0
    assert restored.begin_step() == 1.0 and restored.cum_wait == 4.0  # the totals continue after a resume


def _model_and_guard():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt, NonFiniteGuard(opt)


@pytest.mark.parametrize("poison", ["loss", "grad"])
def test_guard_skips_a_step_with_a_non_finite_loss_or_gradient(poison):
    model, opt, guard = _model_and_guard()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    guard.begin()
    loss = model(torch.ones(2, 3)).sum()
    if poison == "loss":
        loss = loss + torch.tensor(math.nan)  # NaN loss, finite gradients
    loss.backward()
    if poison == "grad":
        model.weight.grad[0, 1] = math.inf
    guard.report_loss(loss)
    opt.step()
    assert not guard.stepped
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert opt.state_dict()["state"] == {}  # AdamW's moments untouched
    opt.zero_grad()
    guard.begin()  # the next, healthy update steps
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    assert guard.stepped and not torch.equal(before["weight"], model.weight)


def test_guard_follows_the_other_ranks_verdict():
    model, opt, _ = _model_and_guard()
    guard = NonFiniteGuard(opt, agree=lambda ok: False)  # another rank saw a NaN
    guard.begin()
    model(torch.ones(2, 3)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    assert not guard.stepped and torch.equal(before, model.weight)


def test_finiteness_checks_and_single_process_collectives():
    p = torch.nn.Parameter(torch.ones(2))
    assert params_finite([p]) and grads_finite(torch.optim.SGD([p], lr=1.0))
    p.grad = torch.tensor([1.0, math.nan])
    assert not grads_finite(torch.optim.SGD([p], lr=1.0))
    assert not params_finite([torch.tensor([1.0, -math.inf])])
    assert gather_objects({"a": 1}) == [{"a": 1}] and all_ranks_agree(False) is False
    items = list(range(7))
    parts = [strided_share(items, r, 3) for r in range(3)]
    assert parts == [[0, 3, 6], [1, 4], [2, 5]] and unstride(parts, 7) == items


class _PlainEngine(torch.nn.Module):
    """The DeepSpeed engine's training interface over a plain model and optimizer (steps after ``accum`` calls)."""

    def __init__(self, model, opt, accum: int):
        super().__init__()
        self.module, self.opt, self.accum, self.calls = model, opt, accum, 0

    def forward(self, **kw):
        return self.module(**kw)

    def backward(self, loss, scale_wrt_gas):
        assert scale_wrt_gas is False
        loss.backward()

    def step(self):
        self.calls += 1
        if self.calls % self.accum == 0:
            self.opt.step()
            self.opt.zero_grad()

    def get_global_grad_norm(self):
        return 0.0


def test_policy_updater_runs_micro_batches_to_one_guarded_step(tiny_model):
    from transformers import AutoModelForCausalLM

    from mugrpo_async.algo import policy_loss
    from mugrpo_async.config import load_config
    from mugrpo_async.training.batching import token_logprobs
    from mugrpo_async.training.update import PolicyUpdater

    groups = [_group(k, [1.0, 0.0], [3, 4], version=0) for k in range(2)]
    cfg = load_config(None, [f"model.path={tiny_model}", "rollout.group_size=2", "schedule.groups_per_update=2",
                             "trainer.micro_batch_size=3", "rollout.temperature=0.5"])  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = _PlainEngine(model, opt, accum=cfg.micro_batches_per_rank)
    updater = PolicyUpdater(engine, cfg, 0, 1, NonFiniteGuard(opt))
    m = updater.update(groups)
    assert engine.calls == 2 and updater.num_updates == 1 and m["nonfinite_skipped"] == 0.0
    # One pass over the whole minibatch at temperature 0.5, one SGD step: the same weights.
    batch = collate(flatten(groups), pad_id=0)
    mu_grpo = {"clip_low": 0.0, "clip_high": 5.0, "nav_tau": 1e-4, "nav_scope": "sequence"}
    logp = token_logprobs(reference, batch, 0.5)
    loss, _ = policy_loss(logp, batch.behavior_logprobs, batch.advantages, batch.response_mask, **mu_grpo)
    loss.backward()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_opt.step()
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-5)
    gap = max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), reference.parameters()))
    assert gap < 1e-5
    assert m["mismatch_tokens"] == 14  # every row was generated by version 0: lag 0 at update 0
    groups[1].advantages[0] = math.nan
    before = [p.detach().clone() for p in model.parameters()]
    m2 = updater.update(groups)
    assert m2["nonfinite_skipped"] == 1.0 and m2["mismatch_tokens"] == 0  # lag 1 now
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
