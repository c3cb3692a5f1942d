"""The algorithm options beside the paper's defaults, each off by default, on hand-computed cases (no Ray):
Dr. GRPO (advantages without the std, `seq_mean_token_sum_norm`), overlong handling (mask, DAPO's soft penalty),
the learning-rate warmup and schedule (with its checkpoint position), and the update record's new fields.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from mugrpo_async.algo import LossSpec, aggregate, group_advantages, overlong_penalty, policy_loss
from mugrpo_async.checkpoints.trainer_state import load_trainer_tree, save_rank_state
from mugrpo_async.config import ConfigError, load_config
from mugrpo_async.reporting.metrics import update_record
from mugrpo_async.rollout import groups
from mugrpo_async.rollout.samples import Group
from mugrpo_async.training.lr_schedule import build_lr_scheduler, lr_factor, restore_scheduler, scheduler_state
from mugrpo_async.training.minibatch import rank_share

GRPO = {"clip_low": 0.8, "clip_high": 1.2, "nav_tau": 1e-4, "nav_scope": "none"}
MU_GRPO = {"clip_low": 0.0, "clip_high": 5.0, "nav_tau": 1e-4, "nav_scope": "sequence"}


def test_defaults_stay_the_papers():
    cfg = load_config(None, [])
    assert cfg.algo.advantage_std_norm is True and cfg.algo.loss_agg == "seq_mean_token_mean"
    assert cfg.algo.overlong == "none" and cfg.rollout.dynamic_sampling is False
    assert cfg.trainer.lr_schedule == "constant" and cfg.trainer.lr_warmup_updates == 0
    assert cfg.logging.wandb is False


def test_dr_grpo_advantages_skip_the_std():
    R = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    # mean 0.25: A = (0.75, -0.25, -0.25, -0.25); the paper's divides by std = 0.5 (unbiased) + 1e-6.
    assert group_advantages(R, std_norm=False).tolist() == [[0.75, -0.25, -0.25, -0.25], [0.0] * 4]
    torch.testing.assert_close(group_advantages(R)[0], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6))


def test_seq_mean_token_sum_norm_hand_computed():
    values = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()
    # (1/N) sum_i (1/L) sum_t v: N = 2, L = 10: ((1 + 2) + 3) / 10 / 2 = 0.3, whatever the lengths T_i.
    assert aggregate(values, mask, mask, "seq_mean_token_sum_norm", norm_len=10).item() == pytest.approx(0.3)
    # Loss: T = (2, 1), A = (1, -2), ratios (2, 0.5 | 0.25), clip [0.8, 1.2]; s = (1.2, 0.5 | -1.6); L = 4.
    l = torch.log(torch.tensor([[2.0, 0.5], [0.25, 1.0]]))
    loss, _ = policy_loss(l, torch.zeros(2, 2), torch.tensor([1.0, -2.0]), mask[:, :2],
                          loss_agg="seq_mean_token_sum_norm", norm_len=4, **GRPO)  # fmt: skip
    assert loss.item() == pytest.approx(-(1.2 + 0.5 - 1.6) / 4 / 2, rel=1e-6)


def test_sum_norm_micro_batches_equal_the_full_pass():
    g = torch.Generator().manual_seed(0)
    l, b = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 3, 1, 4, 2, 5])[:, None]
    A = torch.randn(6, generator=g)
    kw = {**GRPO, "loss_agg": "seq_mean_token_sum_norm", "norm_len": 8}
    full, _ = policy_loss(l, b, A, mask, **kw)
    parts = [policy_loss(l[s][:, :t], b[s][:, :t], A[s], mask[s][:, :t], num_sequences=6, **kw)[0]
             for s, t in ((slice(0, 2), 5), (slice(2, 3), 1), (slice(3, 6), 5))]  # fmt: skip
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-6)


def test_loss_spec_takes_the_response_limit_as_norm_len():
    cfg = load_config(None, ["algo.loss_agg=seq_mean_token_sum_norm", "rollout.max_new_tokens=32"])
    spec = LossSpec.from_config(cfg.algo, cfg.rollout.max_new_tokens)
    assert spec.loss_agg == "seq_mean_token_sum_norm" and spec.norm_len == 32
    with pytest.raises(ValueError, match="norm_len"):
        LossSpec(**GRPO, norm_len=0)


def test_overlong_penalty_hand_computed():
    lengths = torch.tensor([10, 16, 17, 18, 20])
    # L_max = 20, buffer 4: free up to 16 tokens, then -1/4 per token, -1 at 20.
    assert overlong_penalty(lengths, 20, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 20, 21)


def _completion(n_tokens: int, finish: str):
    return SimpleNamespace(token_ids=[1] * n_tokens, logprobs=[{1: SimpleNamespace(logprob=-0.5)}] * n_tokens,
                           text="", finish_reason=finish)  # fmt: skip


def test_make_group_soft_penalty_and_dr_grpo_advantages():
    prompt = {"prompt_id": "p", "prompt_ids": [5], "answer": "1"}
    out = SimpleNamespace(outputs=[_completion(2, "stop"), _completion(4, "length"), _completion(3, "stop")])
    cfg = load_config(None, ["algo.overlong=soft_penalty", "algo.overlong_buffer=2", "rollout.max_new_tokens=4",
                             "algo.advantage_std_norm=false"])  # fmt: skip
    g = groups.make_group(prompt, out, [1.0, 1.0, 0.0], 0, 0, **groups.advantage_options(cfg))
    # penalties (0, -1, -0.5): shaped rewards (1, 0, -0.5), mean 1/6; no std: A = R - mean.
    assert g.rewards == [1.0, 1.0, 0.0] and g.meta["overlong_penalty"] == [0.0, -1.0, -0.5]
    assert g.advantages == pytest.approx([5 / 6, -1 / 6, -2 / 3], abs=1e-6)
    plain = groups.make_group(prompt, out, [1.0, 1.0, 1.0], 0, 0, **groups.advantage_options(load_config(None, [])))
    assert plain.advantages == [0.0] * 3 and "overlong_penalty" not in plain.meta


def _group(pid: str, lengths: list[int], finish: list[str], rewards: list[float]) -> Group:
    return Group(pid, [1], "a", [[2] * n for n in lengths], [[-0.1] * n for n in lengths], rewards,
                 [0.5] * len(lengths), 0, finish)  # fmt: skip


def test_mask_truncated_leaves_them_out_of_the_loss_and_the_totals():
    mb = [_group("a", [3, 5], ["stop", "length"], [1.0, 0.0]), _group("b", [2, 5], ["length", "stop"], [0.0, 1.0])]
    share = rank_share(mb, 0, 1, False, mask_truncated=True)
    assert share.totals == {"num_sequences": 2, "num_tokens": 3 + 5} and share.truncated_masked == 2
    # the two truncated rows (5 and 2 tokens) keep no token; the others keep all of theirs
    assert sorted(share.batch.response_mask.sum(1).tolist()) == [0, 0, 3, 5]
    keep_all = rank_share(mb, 0, 1, False)
    assert keep_all.totals == {"num_sequences": 4, "num_tokens": 15} and keep_all.truncated_masked == 0


@pytest.mark.parametrize(
    "schedule, expected",
    [("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
     ("linear", [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]),
     ("cosine", [0.5, 1.0, 1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2])],
)  # fmt: skip
def test_lr_factor_hand_computed(schedule, expected):
    # W = 2 warmup updates, U = 6: warmup (1/2, 2/2), then p = (u - 2) / 4.
    assert [lr_factor(u, 2, schedule, 6) for u in range(6)] == pytest.approx(expected)
    assert [lr_factor(u, 0, schedule, 6) for u in range(1)] == [1.0]


def _lrs(sched, opt, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_scheduler_resume_restores_the_lr_sequence(tmp_path):
    t = SimpleNamespace(lr_warmup_updates=2, lr_schedule="linear")
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    sched = build_lr_scheduler(opt, t, 6)
    first = _lrs(sched, opt, 3)
    (tmp_path / "trainer").mkdir()
    save_rank_state(tmp_path, 0, opt.state_dict(), 3, 1, 0, {}, scheduler_state(sched))
    rest = _lrs(sched, opt, 3)
    assert first + rest == pytest.approx([1e-3 * f for f in (0.5, 1.0, 1.0, 0.75, 0.5, 0.25)])
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    sched2 = build_lr_scheduler(opt2, t, 6)
    tree = load_trainer_tree(tmp_path, 0, opt2.state_dict(), 1, 0)
    opt2.load_state_dict(tree["optimizer"])
    restore_scheduler(sched2, tree["lr_scheduler"])
    assert _lrs(sched2, opt2, 3) == pytest.approx(rest)


def test_checkpoint_without_a_scheduler_reads_the_update_count(tmp_path):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    (tmp_path / "trainer").mkdir()
    save_rank_state(tmp_path, 0, opt.state_dict(), 5, 1, 0, {})  # as written before the schedule existed
    assert load_trainer_tree(tmp_path, 0, opt.state_dict(), 1, 0)["lr_scheduler"] == {"last_epoch": 5}


def test_update_record_carries_lr_and_truncated_count():
    ones = torch.ones(1, 2).bool()
    _, loss_metrics = policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), ones, **GRPO)
    m = loss_metrics | {
        "reward_sum": 1.0, "response_len_sum": 4.0, "lag_sum": 0.0, "num_rows": 2, "loss": 0.5, "grad_norm": 1.0,
        "lag_max": 0, "t_wait_s": 0.0, "t_step_s": 1.0, "cum_wait_s": 0.0, "cum_busy_s": 1.0, "lr": 2.5e-7,
        "truncated_masked": 3,
    }  # fmt: skip
    rec = update_record([m, dict(m)], update=1, policy_version=0)
    assert rec["lr"] == 2.5e-7 and rec["truncated_masked"] == 3


def test_update_record_carries_the_veto_counts_and_the_ratio_histogram():
    """A stage's token-weighted veto fraction needs the counts; the histogram's bins hold every A < 0 token."""
    mask = torch.ones(2, 3).bool()
    logp = torch.tensor([[0.0, -12.0, 0.0], [0.0, 0.0, 0.0]])  # row 0's second token: rho = e^-12 < tau
    _, part = policy_loss(logp, torch.zeros(2, 3), torch.tensor([-1.0, 1.0]), mask, **MU_GRPO)
    m = part | {"reward_sum": 1.0, "response_len_sum": 6.0, "lag_sum": 0.0, "num_rows": 2, "grad_norm": 1.0,
                "lag_max": 0, "t_wait_s": 0.0, "t_step_s": 1.0, "cum_wait_s": 0.0, "cum_busy_s": 1.0}  # fmt: skip
    rec = update_record([m, dict(m)], update=1, policy_version=0)
    assert (rec["num_tokens"], rec["num_vetoed"]) == (12.0, 6.0)  # S_seq: all of row 0 on both ranks
    assert rec["nav_veto_frac"] == pytest.approx(rec["num_vetoed"] / rec["num_tokens"])
    hist = rec["hist_log_ratio_neg_adv"]
    assert sum(hist.values()) == 6.0 and hist["161"] == 4.0  # rho = 1: log10 = 0, bin 1 + 8 x 20
    assert len(hist) == 2 and json.loads(json.dumps(rec))["hist_log_ratio_neg_adv"] == hist


@pytest.mark.parametrize(
    "overrides, key",
    [(["algo.overlong=soft_penalty"], "algo.overlong_buffer"),
     (["algo.overlong=soft_penalty", "algo.overlong_buffer=25"], "algo.overlong_buffer"),
     (["rollout.dynamic_sampling=true", "rollout.max_refill_rounds=-1"], "rollout.max_refill_rounds"),
     (["algo.loss_agg=seq_sum"], "algo.loss_agg"), (["trainer.lr_schedule=step"], "trainer.lr_schedule"),
     (["trainer.lr_warmup_updates=-1"], "trainer.lr_warmup_updates")],
)  # fmt: skip
def test_bad_options_name_their_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, overrides)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step")  # the guard re-wraps the tracked step
def test_scheduler_under_the_non_finite_guard():
    """The trainer's order: scheduler, then the guard around the optimizer's step; a skipped step still advances
    the schedule (one position per update) and every finite step applies."""
    from mugrpo_async.training.guard import NonFiniteGuard

    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.0)
    sched = build_lr_scheduler(opt, SimpleNamespace(lr_warmup_updates=2, lr_schedule="constant"), 4)
    guard = NonFiniteGuard(opt)
    seen = []
    for grad in (1.0, math.nan, 1.0):
        guard.begin()
        p.grad = torch.full((2,), grad)
        seen.append((opt.param_groups[0]["lr"], guard.stepped))
        before = p.detach().clone()
        opt.step()
        assert guard.stepped == (not math.isnan(grad)) and torch.equal(p.detach(), before) == math.isnan(grad)
        sched.step()
    assert [lr for lr, _ in seen] == pytest.approx([0.5e-3, 1e-3, 1e-3])
