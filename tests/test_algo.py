"""Unit tests of `mugrpo_async.algo`: hand-computed cases, properties, vectorised vs loop, micro-batching.

.venv/bin/python -m pytest tests/test_algo.py -q
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mugrpo_async import algo, choices
from mugrpo_async.algo import (
    LOSS_AGGS,
    NAV_SCOPES,
    aggregate,
    clipped_surrogate,
    group_advantages,
    kl_k3,
    m2po_mask,
    merge_metrics,
    nav_mask,
    nonconstant_groups,
    policy_loss,
)

MU_GRPO = {"clip_low": 0.0, "clip_high": 5.0, "nav_tau": 1e-4, "nav_scope": "sequence"}
GRPO = {"clip_low": 0.8, "clip_high": 1.2, "nav_tau": 1e-4, "nav_scope": "none"}
SETTINGS = settings(max_examples=100, deadline=None)


def bools(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def log_of(rows: list[list[float]]) -> torch.Tensor:
    """(B, T) log ratios from ratios."""
    return torch.tensor(rows, dtype=torch.float64).log().float()


# ----------------------------------------------------------------------------- group advantages


def test_group_advantages_hand_computed():
    A = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 2.0, 3.0, 2.0]]))
    std0 = math.sqrt(4 * 0.25 / 3)  # unbiased: divide by G - 1
    std1 = math.sqrt(2 / 3)
    row0 = [0.5 / (std0 + 1e-6), -0.5 / (std0 + 1e-6), -0.5 / (std0 + 1e-6), 0.5 / (std0 + 1e-6)]
    row1 = [-1.0 / (std1 + 1e-6), 0.0, 1.0 / (std1 + 1e-6), 0.0]
    expected = torch.tensor([row0, row1])
    assert A.dtype == torch.float32
    torch.testing.assert_close(A, expected)


def test_group_advantages_equal_rewards_are_exact_zeros():
    rewards = torch.tensor([[0.1] * 8, [1.0] * 8, [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    A = group_advantages(rewards)
    assert (A[:2] == 0.0).all()
    assert (A[2] != 0).all()
    assert nonconstant_groups(rewards).tolist() == [False, False, True]
    assert (group_advantages(torch.tensor([[3.0], [1.0]])) == 0).all()  # G = 1: no signal, no NaN
    assert group_advantages(torch.tensor([[0, 1]])).dtype == torch.float32  # integer rewards
    assert group_advantages(torch.tensor([[0.0, 1.0]], dtype=torch.float64)).dtype == torch.float64


# ----------------------------------------------------------------------------- NAV, hand cases

# (ratios, response mask, A, tau, {scope: expected keep})
NAV_CASES = {
    "several_triggers": (
        [[1, 0.01, 1, 0.01, 1]], [[1, 1, 1, 1, 1]], [-1.0], 0.1,
        {"none": [1, 1, 1, 1, 1], "trigger": [1, 0, 1, 0, 1], "suffix": [1, 1, 0, 0, 0],
         "suffix_nontrigger": [1, 1, 0, 1, 0], "sequence": [0, 0, 0, 0, 0]},
    ),
    "trigger_at_first_token": (
        [[0.01, 1, 1]], [[1, 1, 1]], [-1.0], 0.1,
        {"none": [1, 1, 1], "trigger": [0, 1, 1], "suffix": [1, 0, 0], "suffix_nontrigger": [1, 0, 0],
         "sequence": [0, 0, 0]},
    ),
    "trigger_at_last_token": (
        [[1, 1, 0.01, 1]], [[1, 1, 1, 0]], [-0.5], 0.1,
        {"none": [1, 1, 1, 0], "trigger": [1, 1, 0, 0], "suffix": [1, 1, 1, 0],
         "suffix_nontrigger": [1, 1, 1, 0], "sequence": [0, 0, 0, 0]},
    ),
    "trigger_inside_padding_does_not_count": (
        [[1, 1, 0.01, 0.01]], [[1, 1, 0, 0]], [-1.0], 0.1,
        dict.fromkeys(NAV_SCOPES, [1, 1, 0, 0]),
    ),
    "positive_advantage_never_masked": (
        [[0.01, 1e-9, 1]], [[1, 1, 1]], [2.0], 0.1, dict.fromkeys(NAV_SCOPES, [1, 1, 1]),
    ),
    "zero_advantage_never_masked": (
        [[0.01, 1e-9, 1]], [[1, 1, 1]], [0.0], 0.1, dict.fromkeys(NAV_SCOPES, [1, 1, 1]),
    ),
    "tau_above_all_ratios": (
        [[1, 2, 0.5]], [[1, 1, 1]], [-1.0], 10.0,
        {"none": [1, 1, 1], "trigger": [0, 0, 0], "suffix": [1, 0, 0], "suffix_nontrigger": [1, 1, 1],
         "sequence": [0, 0, 0]},
    ),
    "tau_below_all_ratios": (
        [[1e-3, 2, 0.5]], [[1, 1, 1]], [-1.0], 1e-4, dict.fromkeys(NAV_SCOPES, [1, 1, 1]),
    ),
    "tau_zero_disables": ([[1e-30, 1]], [[1, 1]], [-1.0], 0.0, dict.fromkeys(NAV_SCOPES, [1, 1])),
}  # fmt: skip


@pytest.mark.parametrize("scope", NAV_SCOPES)
@pytest.mark.parametrize("case", sorted(NAV_CASES))
def test_nav_mask_hand_cases(case, scope):
    ratios, mask, A, tau, expected = NAV_CASES[case]
    keep = nav_mask(log_of(ratios), torch.tensor(A), bools(mask), tau, scope)
    assert keep.dtype == torch.bool
    assert keep.tolist() == bools([expected[scope]]).tolist()


def test_nav_mask_rows_are_independent():
    ratios = [[1, 0.01, 1, 1], [0.01, 1, 1, 1], [1, 1, 1, 0.01]]
    mask = bools([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])
    keep = nav_mask(log_of(ratios), torch.tensor([-1.0, 1.0, -1.0]), mask, 0.1, "suffix")
    assert keep.tolist() == bools([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]).tolist()


def test_suffix_nontrigger_is_not_monotone_in_tau():
    """A larger tau turns a dropped non-trigger token into a (kept) trigger token."""
    lr, A, mask = log_of([[0.01, 0.5]]), torch.tensor([-1.0]), bools([[1, 1]])
    assert nav_mask(lr, A, mask, 0.1, "suffix_nontrigger").tolist() == [[True, False]]
    assert nav_mask(lr, A, mask, 1.0, "suffix_nontrigger").tolist() == [[True, True]]


def test_nav_trigger_is_exact_in_log_space():
    """rho < tau is decided on the log ratio exactly, not after rounding exp() or log(tau) to float32."""
    log_tau32 = torch.tensor(math.log(0.1))  # rounds below log(0.1)
    assert log_tau32.item() < math.log(0.1)
    just_above = torch.nextafter(log_tau32, torch.tensor(0.0))
    lr = torch.stack([log_tau32, just_above, torch.tensor(-1e-19)])[None, :]
    A, mask = torch.tensor([-1.0]), bools([[1, 1, 1]])
    assert nav_mask(lr, A, mask, 0.1, "trigger").tolist() == [[False, True, True]]
    assert nav_mask(lr, A, mask, 1.0, "trigger").tolist() == [[False, False, False]]  # exp(-1e-19) < 1
    assert nav_mask(lr.double(), A, mask, 0.1, "trigger").tolist() == [[False, True, True]]
    assert nav_mask(lr.bfloat16(), A, mask, 1.0, "trigger").tolist() == [[False, False, False]]


def test_nav_mask_errors():
    lr, A, mask = torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="suffix_nontrigger"):
        nav_mask(lr, A, mask, 0.1, "prefix")
    with pytest.raises(TypeError, match="bool"):
        nav_mask(lr, A, mask.float(), 0.1, "sequence")
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        nav_mask(lr, A[:, None], mask, 0.1, "sequence")
    with pytest.raises(ValueError, match="nav_tau"):
        nav_mask(lr, A, mask, -1.0, "sequence")


# ----------------------------------------------------------------------------- NAV, properties


def nav_mask_loop(log_ratio, advantages, response_mask, tau, scope):
    """Reference: the definition of DESIGN.md, one response and one token at a time.

    rho < tau is evaluated as log rho < log tau in float64: exp(-1e-19) rounds to 1.0, its log does not.
    """
    B, T = log_ratio.shape
    keep = response_mask.clone()
    for i in range(B):
        if not advantages[i] < 0:
            continue
        log_tau = math.log(tau) if tau > 0 else -math.inf
        trig = [t for t in range(T) if response_mask[i, t] and float(log_ratio[i, t]) < log_tau]
        if not trig:
            continue
        kappa = trig[0]
        for t in range(T):
            drop = {
                "none": False,
                "trigger": t in trig,
                "suffix": t > kappa,
                "suffix_nontrigger": t > kappa and t not in trig,
                "sequence": True,
            }[scope]
            keep[i, t] = keep[i, t] and not drop
    return keep


SPECIAL_LOG_RATIOS = [-50.0, -12.0, -9.5, -4.0, -2.0, -0.3, 0.0, 0.2, 1.5, 50.0]
LOG_RATIO_VALUES = st.sampled_from(SPECIAL_LOG_RATIOS) | st.floats(-15.0, 5.0)


@st.composite
def nav_batches(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(0, 7))
    cells = st.lists(st.lists(LOG_RATIO_VALUES, min_size=T, max_size=T), min_size=B, max_size=B)
    log_ratio = torch.tensor(draw(cells), dtype=torch.float32).reshape(B, T)
    masks = st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=B, max_size=B)
    mask = torch.tensor(draw(masks), dtype=torch.bool).reshape(B, T)
    A = torch.tensor(draw(st.lists(st.sampled_from([-1.5, -0.2, 0.0, 0.3, 1.0]), min_size=B, max_size=B)))
    return log_ratio, A, mask


TAUS = st.sampled_from([0.0, 1e-4, 1e-2, 0.1, 1.0, 10.0])


@SETTINGS
@given(nav_batches(), TAUS)
def test_nav_mask_matches_loop_reference(batch, tau):
    log_ratio, A, mask = batch
    for scope in NAV_SCOPES:
        expected = nav_mask_loop(log_ratio, A, mask, tau, scope)
        assert torch.equal(nav_mask(log_ratio, A, mask, tau, scope), expected), scope


@SETTINGS
@given(nav_batches(), TAUS)
def test_nav_dropped_sets_nest_and_spare_nonnegative_advantages(batch, tau):
    log_ratio, A, mask = batch
    dropped = {s: mask & ~nav_mask(log_ratio, A, mask, tau, s) for s in NAV_SCOPES}
    assert not dropped["none"].any()
    assert torch.equal(dropped["suffix"] & ~dropped["sequence"], torch.zeros_like(mask))  # sequence ⊇ suffix
    assert not (dropped["suffix_nontrigger"] & ~dropped["suffix"]).any()  # suffix ⊇ suffix_nontrigger
    assert not (dropped["trigger"] & ~dropped["sequence"]).any()
    assert not (dropped["trigger"] & dropped["suffix_nontrigger"]).any()
    for s in NAV_SCOPES:
        assert not dropped[s][A >= 0].any(), s


@SETTINGS
@given(nav_batches(), TAUS, TAUS)
def test_smaller_tau_never_masks_more(batch, tau_a, tau_b):
    log_ratio, A, mask = batch
    small, big = sorted((tau_a, tau_b))

    def dropped(tau, scope):
        return mask & ~nav_mask(log_ratio, A, mask, tau, scope)

    for scope in ("none", "trigger", "suffix", "sequence"):
        assert not (dropped(small, scope) & ~dropped(big, scope)).any(), scope
    # suffix_nontrigger alone is not monotone (see the hand case); with its triggers added it is.
    snt = {tau: dropped(tau, "suffix_nontrigger") | dropped(tau, "trigger") for tau in (small, big)}
    assert not (snt[small] & ~snt[big]).any()


# ----------------------------------------------------------------------------- policy loss: gradients


def make_batch(B=6, T=9, seed=0, drift=1.0):
    g = torch.Generator().manual_seed(seed)
    b = -torch.rand(B, T, generator=g) * 3
    l = b + drift * torch.randn(B, T, generator=g)
    l[0, 2] = b[0, 2] + 3.0  # rho = e^3 > 5: clipped if A_0 > 0
    l[1, 1] = b[1, 1] - 12.0  # rho < 1e-4: a trigger if A_1 < 0
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[:2] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    A = torch.randn(B, generator=g)
    A[0], A[1] = 1.0, -1.0
    return l, b, A, mask


def expected_grad(l, b, A, mask, opts, loss_agg):
    rho = (l - b).exp()
    keep = nav_mask(l - b, A, mask, opts["nav_tau"], opts["nav_scope"])
    a = A[:, None]
    clipped = ((a > 0) & (rho > opts["clip_high"])) | ((a < 0) & (rho < opts["clip_low"]))
    if loss_agg == "seq_mean_token_mean":
        denom = l.shape[0] * mask.sum(1, keepdim=True).clamp(min=1)
    elif loss_agg == "seq_mean_token_sum_norm":  # N x the padded length (no norm_len given)
        denom = l.shape[0] * l.shape[1]
    else:
        denom = mask.sum()
    return torch.where(keep & ~clipped, -a * rho / denom, 0.0), keep, clipped


GRAD_OPTS = {"mu": MU_GRPO, "grpo": GRPO, "trig": {**MU_GRPO, "nav_scope": "trigger"}}


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("opts", GRAD_OPTS.values(), ids=GRAD_OPTS.keys())
def test_gradient_formula(opts, loss_agg):
    l, b, A, mask = make_batch()
    l = l.requires_grad_()
    loss, _ = policy_loss(l, b, A, mask, loss_agg=loss_agg, **opts)
    loss.backward()
    expected, keep, clipped = expected_grad(l.detach(), b, A, mask, opts, loss_agg)
    torch.testing.assert_close(l.grad, expected, rtol=1e-5, atol=1e-8)
    assert (l.grad[~keep | clipped | ~mask] == 0).all()  # exactly zero, not small
    if opts["nav_scope"] == "sequence":
        assert (l.grad[1] == 0).all() and not keep[1].any()
    if opts["clip_high"] == 5.0:
        assert l.grad[0, 2] == 0 and clipped[0, 2]


@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
@pytest.mark.parametrize("bounds", [(0.8, 1.2), (0.0, 5.0), (0.0, math.inf), (1.0, 1.0)])
def test_clipped_surrogate_equals_the_min_form(bounds, dual_clip_c):
    """The one-clamp implementation against min(rho A, clip(rho) A) (and max(., c A) for A < 0) as written."""
    g = torch.Generator().manual_seed(0)
    log_rho = 2 * torch.randn(64, 16, generator=g)
    A = torch.randn(64, generator=g)
    A[:8] = 0.0
    lr_impl, lr_ref = log_rho.clone().requires_grad_(), log_rho.clone().requires_grad_()
    s = clipped_surrogate(lr_impl.exp(), A, *bounds, dual_clip_c)
    rho, a = lr_ref.exp(), A[:, None]
    ref = torch.minimum(rho * a, rho.clamp(*bounds) * a)
    if dual_clip_c is not None:
        ref = torch.where(a < 0, torch.maximum(ref, dual_clip_c * a), ref)
    torch.testing.assert_close(s, ref)
    s.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(lr_impl.grad, lr_ref.grad)


def test_loss_value_hand_computed():
    # Two responses; T = (2, 1); A = (1, -2); ratios (2, 0.5 | 0.25); clip [0.8, 1.2], no veto.
    l = torch.log(torch.tensor([[2.0, 0.5], [0.25, 1.0]]))
    b = torch.zeros(2, 2)
    mask = bools([[1, 1], [1, 0]])
    loss, m = policy_loss(l, b, torch.tensor([1.0, -2.0]), mask, **GRPO)
    s = [[min(2.0, 1.2), min(0.5, 0.8)], [min(0.25 * -2, 0.8 * -2)]]  # (1.2, 0.5), (-1.6)
    expected = -((s[0][0] + s[0][1]) / 2 + s[1][0] / 1) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss_tm, _ = policy_loss(l, b, torch.tensor([1.0, -2.0]), mask, loss_agg="token_mean", **GRPO)
    assert loss_tm.item() == pytest.approx(-(1.2 + 0.5 - 1.6) / 3, rel=1e-6)
    # Clipped: ratio 2 > 1.2 with A > 0, ratio 0.25 < 0.8 with A < 0.
    assert m["num_clipped"] == 2 and m["clip_frac"] == pytest.approx(2 / 3)


def test_extreme_log_ratios_bf16_and_infinite_clip():
    l = torch.tensor([[50.0, -50.0, 0.0], [-50.0, 50.0, 0.0]], dtype=torch.bfloat16, requires_grad=True)
    b = torch.zeros(2, 3, dtype=torch.bfloat16)
    mask = bools([[1, 1, 1], [1, 1, 1]])
    for opts in (MU_GRPO, GRPO, {**MU_GRPO, "clip_high": math.inf, "nav_scope": "none"}):
        for loss_agg in LOSS_AGGS:
            l.grad = None
            loss, m = policy_loss(l, b, torch.tensor([1.0, -1.0]), mask, loss_agg=loss_agg, **opts)
            loss.backward()
            assert loss.dtype == torch.float32 and torch.isfinite(loss)
            assert l.grad.dtype == torch.bfloat16 and torch.isfinite(l.grad).all()
            assert all(math.isfinite(v) for v in m.values()), m
            assert 0 < m["ratio_ess"] <= 1


def test_padding_garbage_does_not_leak():
    l = torch.tensor([[-1.0, float("nan"), -math.inf]], requires_grad=True)
    b = torch.tensor([[-1.5, -math.inf, float("nan")]])
    ref = torch.tensor([[-1.0, float("nan"), math.inf]])
    mask = bools([[1, 0, 0]])
    loss, m = policy_loss(l, b, torch.tensor([1.0]), mask, **MU_GRPO, kl_coef=0.1, ref_logprobs=ref)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(l.grad).all() and (l.grad[0, 1:] == 0).all()
    assert m["num_tokens"] == 1 and m["ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)


def test_empty_responses_do_not_produce_nan():
    l = torch.zeros(3, 4, requires_grad=True)
    mask = bools([[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    for loss_agg in LOSS_AGGS:
        loss, m = policy_loss(l, torch.zeros(3, 4), torch.tensor([1.0, -1.0, 0.0]), mask, loss_agg=loss_agg,
                              **MU_GRPO)  # fmt: skip
        assert torch.isfinite(loss)
    # N counts every response, T_i = 0 ones included: -(1/3) * (1/2) * (1 + 1).
    loss, _ = policy_loss(l, torch.zeros(3, 4), torch.tensor([1.0, -1.0, 0.0]), mask, **MU_GRPO)
    assert loss.item() == pytest.approx(-1 / 3)
    loss, m = policy_loss(l, torch.zeros(3, 4), torch.ones(3), torch.zeros(3, 4, dtype=torch.bool), **MU_GRPO)
    assert loss.item() == 0.0 and m["num_tokens"] == 0 and math.isnan(m["ratio_min"])
    loss, m = policy_loss(torch.zeros(0, 0), torch.zeros(0, 0), torch.zeros(0), bools([]).reshape(0, 0),
                          **MU_GRPO)  # fmt: skip
    assert loss.item() == 0.0 and m["num_sequences"] == 0


# ----------------------------------------------------------------------------- dual clip, KL, errors


def test_dual_clip_hand_computed():
    opts = {**GRPO, "dual_clip_c": 3.0}
    mask = bools([[1]])
    for ratio, A, expected_loss, expected_grad in [(4.0, -1.0, 3.0, 0.0), (2.0, -1.0, 2.0, 2.0),
                                                   (4.0, 1.0, -1.2, 0.0), (0.5, -1.0, 0.8, 0.0)]:  # fmt: skip
        l = torch.tensor([[math.log(ratio)]], requires_grad=True)
        loss, m = policy_loss(l, torch.zeros(1, 1), torch.tensor([A]), mask, **opts)
        loss.backward()
        assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
        assert l.grad.item() == pytest.approx(expected_grad, rel=1e-6)
        assert m["num_dual_clipped"] == (ratio == 4.0 and A < 0)
    with pytest.raises(ValueError, match="dual_clip_c"):
        policy_loss(l, torch.zeros(1, 1), torch.tensor([1.0]), mask, **GRPO, dual_clip_c=1.0)


def test_kl_k3_hand_computed():
    l = torch.log(torch.tensor([[0.5, 0.2]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.25, 0.9]]))
    mask = bools([[1, 0]])
    k3 = 0.5 - math.log(0.5) - 1  # exp(ref - l) - (ref - l) - 1 with ref - l = log(0.5)
    assert kl_k3(l, ref, mask)[0, 0].item() == pytest.approx(k3, rel=1e-6)
    assert kl_k3(l, ref, mask)[0, 1].item() == 0.0
    loss, m = policy_loss(l, l.detach(), torch.tensor([0.0]), mask, **MU_GRPO, kl_coef=0.1, ref_logprobs=ref)
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * k3, rel=1e-6) and m["kl"] == pytest.approx(k3, rel=1e-6)
    assert l.grad[0, 0].item() == pytest.approx(0.1 * (1 - 0.5), rel=1e-5)  # d k3 / d l = 1 - exp(ref - l)
    _, m = policy_loss(l, l.detach(), torch.tensor([0.0]), mask, **MU_GRPO, ref_logprobs=ref)
    assert m["kl"] == pytest.approx(k3, rel=1e-6) and m["loss"] == 0.0  # reported, not added
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(l, l, torch.tensor([0.0]), mask, **MU_GRPO, kl_coef=0.1)


def test_policy_loss_errors():
    l, b, A, mask = make_batch(B=2, T=3)
    with pytest.raises(ValueError, match="seq_mean_token_mean, token_mean"):
        policy_loss(l, b, A, mask, **MU_GRPO, loss_agg="sum")
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(l, b, A, mask, **{**MU_GRPO, "clip_low": 1.5})
    with pytest.raises(ValueError, match="shape"):
        policy_loss(l, b[:, :2], A, mask, **MU_GRPO)
    with pytest.raises(ValueError, match="num_sequences"):
        policy_loss(l, b, A, mask, **MU_GRPO, num_sequences=1)
    with pytest.raises(TypeError, match="bool"):
        policy_loss(l, b, A, mask.long(), **MU_GRPO)
    with pytest.raises(ValueError, match="m2po_threshold"):
        policy_loss(l, b, A, mask, **MU_GRPO, m2po_threshold=-1.0)


def test_constants_are_shared_and_torch_free():
    assert algo.NAV_SCOPES is choices.NAV_SCOPES and algo.LOSS_AGGS is choices.LOSS_AGGS
    code = "import sys, mugrpo_async.choices; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- metrics, micro-batching


BASE_METRIC_KEYS = {
    "loss", "num_sequences", "num_tokens", "num_clipped", "num_vetoed", "num_neg_adv_seqs",
    "num_trigger_seqs", "num_neg_adv_tokens", "ratio_sum", "ratio_sq_sum", "ratio_sum_neg_adv", "ratio_min",
    "ratio_max",
    "clip_frac", "nav_veto_frac", "nav_trigger_seq_frac", "ratio_mean", "ratio_mean_neg_adv", "ratio_ess",
    "num_clipped_pos_adv", "num_clipped_neg_adv", "num_pos_adv_tokens", "num_ratio_below_0p1_neg_adv",
    "clip_frac_pos_adv", "clip_frac_neg_adv", "ratio_below_0p1_neg_adv_frac", "ratio_median_neg_adv",
    *(f"hist_log_ratio_neg_adv_{k:03d}" for k in range(202)),
}  # fmt: skip


def test_ratio_statistics_of_negative_advantage_tokens_by_hand():
    """Clip fractions by advantage sign, P(rho < 0.1 | A < 0) and the median ratio of A < 0 tokens, on a batch
    counted by hand; the median is the centre of its histogram bin (within a factor 10 ** (1 / 40))."""
    rho = torch.tensor([[2.0, 0.5, 1.0, 1.0], [0.01, 0.05, 0.2, 3.0], [0.5, 0.7, 9.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    A = torch.tensor([1.0, -1.0, -1.0])
    zero = torch.zeros_like(rho)
    _, m = policy_loss(rho.log(), zero, A, mask, clip_low=0.8, clip_high=1.2, nav_tau=1e-4, nav_scope="none")
    assert m["clip_frac_pos_adv"] == pytest.approx(1 / 3)  # row 0: 2.0 > 1.2 of 3 tokens
    assert m["clip_frac_neg_adv"] == pytest.approx(5 / 7)  # 0.01, 0.05, 0.2 and 0.5, 0.7 < 0.8 of 7 tokens
    assert m["clip_frac"] == pytest.approx(6 / 10)
    assert m["ratio_below_0p1_neg_adv_frac"] == pytest.approx(2 / 7)
    # A < 0 ratios sorted: 0.01 0.05 0.2 0.5 0.7 3.0 9.0 -> the 4th of 7 is 0.5
    assert 0.5 / 10 ** (1 / 40) <= m["ratio_median_neg_adv"] <= 0.5 * 10 ** (1 / 40)
    halves = [
        policy_loss(
            rho[s].log(),
            zero[s],
            A[s],
            mask[s],
            clip_low=0.8,
            clip_high=1.2,
            nav_tau=1e-4,
            nav_scope="none",
            num_sequences=3,
            num_tokens=10,
        )[1]
        for s in (slice(0, 2), slice(2, 3))
    ]
    merged = merge_metrics(halves)  # fmt: skip
    assert merged["ratio_median_neg_adv"] == m["ratio_median_neg_adv"]
    assert merged["clip_frac_neg_adv"] == pytest.approx(5 / 7)


def test_metric_keys():
    l, b, A, mask = make_batch()
    _, m = policy_loss(l, b, A, mask, **MU_GRPO)
    assert set(m) == BASE_METRIC_KEYS
    _, m = policy_loss(l, b, A, mask, **MU_GRPO, dual_clip_c=3.0, m2po_threshold=0.04, ref_logprobs=b)
    extra = {"num_dual_clipped", "dual_clip_frac", "num_m2po_masked", "m2po_mask_frac", "kl_sum", "kl"}
    assert set(m) == BASE_METRIC_KEYS | extra


def test_metrics_hand_computed():
    # Response 0: A = +1, ratios (1, 6); response 1: A = -1, ratios (1e-5, 0.5), triggers; 2: A = -1, (2).
    l = torch.log(torch.tensor([[1.0, 6.0], [1e-5, 0.5], [2.0, 1.0]]))
    mask = bools([[1, 1], [1, 1], [1, 0]])
    _, m = policy_loss(l, torch.zeros(3, 2), torch.tensor([1.0, -1.0, -1.0]), mask, **MU_GRPO)
    ratios = [1.0, 6.0, 1e-5, 0.5, 2.0]
    assert m["num_tokens"] == 5 and m["num_sequences"] == 3
    assert m["clip_frac"] == pytest.approx(1 / 5)  # 6 > 5 with A > 0
    assert m["nav_veto_frac"] == pytest.approx(2 / 5) and m["num_vetoed"] == 2
    assert m["nav_trigger_seq_frac"] == pytest.approx(1 / 2) and m["num_neg_adv_seqs"] == 2
    assert m["num_neg_adv_tokens"] == 3
    assert m["ratio_mean_neg_adv"] == pytest.approx((1e-5 + 0.5 + 2.0) / 3, rel=1e-5)
    assert m["ratio_mean"] == pytest.approx(sum(ratios) / 5, rel=1e-5)
    assert m["ratio_min"] == pytest.approx(1e-5, rel=1e-4) and m["ratio_max"] == pytest.approx(6.0, rel=1e-6)
    assert m["ratio_ess"] == pytest.approx(sum(ratios) ** 2 / (5 * sum(r * r for r in ratios)), rel=1e-5)
    assert all(isinstance(v, float) for v in m.values())
    _, m = policy_loss(l, torch.zeros(3, 2), torch.tensor([1.0, 1.0, 0.0]), mask, **MU_GRPO)
    assert m["nav_trigger_seq_frac"] == 0.0 and math.isnan(m["ratio_mean_neg_adv"])  # undefined, not 0
    assert m["num_neg_adv_tokens"] == 0


MICRO_OPTS = [
    MU_GRPO,
    GRPO,
    {**MU_GRPO, "nav_scope": "suffix_nontrigger", "dual_clip_c": 3.0, "kl_coef": 0.05},
]


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("opts", MICRO_OPTS, ids=["mu", "grpo", "dual_kl"])
def test_micro_batches_sum_to_the_full_pass(opts, loss_agg):
    l, b, A, mask = make_batch(B=10, T=7, seed=3, drift=2.0)
    ref = b + 0.3 * torch.randn(b.shape, generator=torch.Generator().manual_seed(1))
    kw = {**opts, "loss_agg": loss_agg}
    full_l = l.clone().requires_grad_()
    full_loss, full_m = policy_loss(full_l, b, A, mask, **kw, ref_logprobs=ref)
    full_loss.backward()
    micro_l = l.clone().requires_grad_()
    totals = {"num_sequences": 10, "num_tokens": int(mask.sum())}
    parts = [slice(0, 3), slice(3, 4), slice(4, 10)]
    results = []
    for p in parts:
        results.append(policy_loss(micro_l[p], b[p], A[p], mask[p], **kw, **totals, ref_logprobs=ref[p]))
    total_loss = sum(loss for loss, _ in results)
    total_loss.backward()
    torch.testing.assert_close(total_loss, full_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(micro_l.grad, full_l.grad, rtol=1e-6, atol=1e-8)
    merged = merge_metrics([m for _, m in results])
    assert merged.keys() == full_m.keys()
    for key, value in full_m.items():
        assert merged[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_merge_metrics_errors_and_empty_parts():
    l, b, A, mask = make_batch(B=4, T=5)
    _, m_all = policy_loss(l, b, A, mask, **MU_GRPO)
    _, m_empty = policy_loss(l, b, A, torch.zeros_like(mask), **MU_GRPO, num_sequences=8)
    merged = merge_metrics([m_all, m_empty])
    assert merged["ratio_min"] == m_all["ratio_min"] and merged["num_sequences"] == 8
    with pytest.raises(ValueError):
        merge_metrics([])
    _, m_m2po = policy_loss(l, b, A, mask, **MU_GRPO, m2po_threshold=0.04)
    with pytest.raises(ValueError, match="different keys"):
        merge_metrics([m_all, m_m2po])


def test_aggregate_hand_computed():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    keep = bools([[1, 0, 1], [1, 1, 1]])
    mask = bools([[1, 1, 1], [1, 1, 0]])
    assert aggregate(v, keep, mask, "seq_mean_token_mean").item() == pytest.approx(((1 + 3) / 3 + 9 / 2) / 2)
    assert aggregate(v, keep, mask, "token_mean").item() == pytest.approx(13 / 5)
    assert aggregate(v, keep, mask, "token_mean", num_tokens=10).item() == pytest.approx(13 / 10)
    assert aggregate(v, keep, mask, "seq_mean_token_mean", num_sequences=4).item() == pytest.approx(
        ((1 + 3) / 3 + 9 / 2) / 4
    )


# ----------------------------------------------------------------------------- M2PO


def test_m2po_hand_computed():
    # M2 = (0, 0.01, 1, 0.25 | padding 100): mean 0.315 -> mask 1 -> 0.0867 -> mask 0.25 -> 0.005 <= 0.04.
    lr = torch.tensor([[0.0, 0.1, 1.0], [-0.5, 10.0, 0.0]])
    mask = bools([[1, 1, 1], [1, 0, 0]])
    assert m2po_mask(lr, mask, 0.04).tolist() == [[True, True, False], [False, False, False]]
    assert torch.equal(m2po_mask(lr, mask, 0.32), mask)  # threshold above the mean: nothing masked
    assert not m2po_mask(lr, mask, 0.0)[0, 1]  # only exact zeros survive a zero threshold
    assert m2po_mask(lr, mask, 0.0).sum() == 1


@st.composite
def m2po_batches(draw):
    log_ratio, _, mask = draw(nav_batches())
    log_ratio = log_ratio.clamp(-20, 20) / draw(st.sampled_from([1.0, 10.0, 100.0]))
    return log_ratio, mask, draw(st.sampled_from([0.0, 1e-3, 0.04, 0.5, 10.0]))


@SETTINGS
@given(m2po_batches())
def test_m2po_properties(batch):
    log_ratio, mask, threshold = batch
    keep = m2po_mask(log_ratio, mask, threshold)
    m2 = log_ratio.double().square()
    assert not (keep & ~mask).any()
    kept, masked = m2[keep], m2[mask & ~keep]
    if kept.numel():
        assert kept.mean() <= threshold * (1 + 1e-9)
        assert masked.numel() == 0 or masked.min() >= kept.max()  # largest first
    if masked.numel():  # minimal: keeping the smallest masked token back breaks the bound
        restored = torch.cat([kept, masked.min().reshape(1)])
        assert restored.mean() > threshold
    if mask.any() and m2[mask].mean() <= threshold:
        assert torch.equal(keep, mask)


def test_m2po_in_policy_loss():
    l, b, A, mask = make_batch(B=8, T=16, seed=5, drift=0.5)
    l = l.requires_grad_()
    loss, m = policy_loss(l, b, A, mask, **{**MU_GRPO, "nav_scope": "none"}, m2po_threshold=0.04)
    loss.backward()
    keep = m2po_mask(l.detach() - b, mask, 0.04)
    assert m["num_m2po_masked"] == (mask & ~keep).sum().item() > 0
    assert m["m2po_mask_frac"] == pytest.approx(m["num_m2po_masked"] / m["num_tokens"])
    assert (l.grad[mask & ~keep] == 0).all()


def test_loss_spec_is_validated_once_and_matches_the_config():
    from mugrpo_async.algo import LossSpec
    from mugrpo_async.config import load_config

    spec = LossSpec.from_config(load_config(None, ["algo.name=grpo", "algo.dual_clip_c=3"]).algo)
    assert (spec.clip_low, spec.clip_high, spec.nav_scope, spec.dual_clip_c, spec.tis_cap) == (
        0.8,
        1.2,
        "none",
        3,
        None,
    )
    bad = [({"clip_low": 0.9, "clip_high": 0.95}, "ratio bounds"), ({"nav_scope": "all"}, "nav_scope"),
           ({"loss_agg": "sum"}, "loss_agg"), ({"dual_clip_c": 1.0}, "dual_clip_c"), ({"tis_cap": 0.5}, "tis_cap"),
           ({"kl_coef": math.inf}, "kl_coef"), ({"m2po_threshold": math.nan}, "m2po_threshold")]  # fmt: skip
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            LossSpec(**{**MU_GRPO, **change})
    l, b = torch.tensor([[-1.0, -2.0]], requires_grad=True), torch.tensor([[-1.5, -1.0]])
    mask, A = bools([[1, 1]]), torch.tensor([1.0])
    assert policy_loss(l, b, A, mask, LossSpec(**GRPO))[0].item() == policy_loss(l, b, A, mask, **GRPO)[0].item()
    with pytest.raises(TypeError, match="either spec or loss options"):
        policy_loss(l, b, A, mask, LossSpec(**GRPO), clip_low=0.0)


def test_truncated_importance_sampling_value_and_gradient():
    # Two tokens of one response, A = 2 (> 0), relaxed bounds [0, 5]: s_t = w_t * A * rho_t with
    # rho_t = exp(l - b_trainer) and w_t = min(exp(b_trainer - b_engine), C), C = 1.5.
    l = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    b_trainer, b_engine = torch.tensor([[-1.2, -0.5]]), torch.tensor([[-1.0, -1.5]])
    mask, A = bools([[1, 1]]), torch.tensor([2.0])
    rho = torch.exp(l.detach() - b_trainer)  # (e^0.2, 1)
    w = torch.tensor([[math.exp(-0.2), 1.5]])  # e^-0.2 < C; e^1 = 2.72 truncated to 1.5
    expected = -(w * A * rho).sum() / 2  # seq_mean_token_mean, one response of 2 tokens
    spec = {**MU_GRPO, "nav_scope": "none", "tis_cap": 1.5}
    loss, m = policy_loss(l, b_engine, A, mask, trainer_behavior_logprobs=b_trainer, **spec)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    # d/dl of -(w A e^(l - b_trainer)) / 2 = -w A rho / 2 (w detached)
    assert torch.allclose(l.grad, -(w * A * rho) / 2, rtol=1e-6)
    assert m["tis_weight_mean"] == pytest.approx((math.exp(-0.2) + 1.5) / 2, rel=1e-6)
    assert m["tis_truncated_frac"] == 0.5
    with pytest.raises(ValueError, match="go together"):
        policy_loss(l, b_engine, A, mask, **spec)
    # Equal trainer and engine log-probs: weights of 1, the plain loss against b.
    plain, _ = policy_loss(l, b_engine, A, mask, **MU_GRPO)
    same, m1 = policy_loss(l, b_engine, A, mask, trainer_behavior_logprobs=b_engine, **{**MU_GRPO, "tis_cap": 2.0})
    assert same.item() == pytest.approx(plain.item(), rel=1e-6) and m1["tis_weight_mean"] == pytest.approx(1.0)


def test_mismatch_counts_hand_computed_and_merged():
    from mugrpo_async.algo import merge_mismatch, mismatch_counts, mismatch_metrics

    l = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, 0.0, 0.0]])
    b = torch.tensor([[-1.1, -1.8, 0.0], [-0.5, 0.0, 0.0]])
    mask = bools([[1, 1, 0], [1, 0, 0]])  # padding (9.0) never counts
    c = mismatch_counts(l, b, mask)
    d = [0.1, -0.2, 0.0]
    assert c["mismatch_tokens"] == 3
    assert c["mismatch_abs_sum"] == pytest.approx(0.3, rel=1e-6) and c["mismatch_abs_max"] == pytest.approx(0.2)
    assert c["mismatch_k3_sum"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d), rel=1e-5)
    other = mismatch_counts(torch.tensor([[0.0]]), torch.tensor([[-0.5]]), bools([[1]]))
    merged = mismatch_metrics(merge_mismatch([c, other]))
    assert merged["mismatch_tokens"] == 4 and merged["mismatch_logprob_abs_max"] == pytest.approx(0.5)
    assert merged["mismatch_logprob_abs_mean"] == pytest.approx(0.8 / 4, rel=1e-6)
    assert merged["mismatch_kl"] == pytest.approx((c["mismatch_k3_sum"] + math.exp(0.5) - 1.5) / 4, rel=1e-5)
    assert mismatch_metrics(mismatch_counts(l, b, torch.zeros_like(mask))) == {}


def test_nav_mask_returns_its_triggers_on_request():
    log_ratio = torch.tensor([[0.0, -20.0, 0.0], [-20.0, 0.0, 0.0]])
    A, mask = torch.tensor([-1.0, 1.0]), bools([[1, 1, 1], [1, 1, 0]])
    keep, trig = nav_mask(log_ratio, A, mask, 1e-4, "suffix", with_triggers=True)
    assert trig.tolist() == [[False, True, False], [False, False, False]]  # the positive response never triggers
    assert keep.tolist() == [[True, True, False], [True, True, False]]
    assert torch.equal(keep, nav_mask(log_ratio, A, mask, 1e-4, "suffix"))
