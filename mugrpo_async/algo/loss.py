"""The mu-GRPO policy loss: ratios, clipping, the veto and M2PO masks applied, one aggregation point, KL.

Equations as in DESIGN.md ("The method, exactly"). Shapes: `B` responses in a (micro-)batch, `T` padded
response length, `G` responses per prompt group. No Ray, no model code; runs on any device. Tests:

    .venv/bin/python -m pytest tests/test_algo.py -q
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mugrpo_async.algo.diagnostics import derive, loss_counts
from mugrpo_async.algo.masks import _NAV_DROP, _check_mask, _check_name, _nav_triggers, m2po_mask
from mugrpo_async.choices import LOSS_AGGS, NAV_SCOPES

LOG_RATIO_CLAMP = 20.0
"""Bound on |l - b| (and |ref - l|) before `exp`: exp(20) ~ 4.9e8 keeps rho * A, rho**2 and their sums over
millions of tokens finite in float32 for log ratios of +-50 or +-inf. Inside the bound the clamp is the
identity, gradient included; beyond it the token's gradient is zero (ratios no trust region lets through)."""


def clipped_surrogate(
    rho: Tensor, advantages: Tensor, clip_low: float, clip_high: float, dual_clip_c: float | None = None
) -> Tensor:
    """Per-token surrogate s = min(rho * A, clip(rho, clip_low, clip_high) * A).

    With dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"), responses with
    A < 0 use s = max(s, c * A), which bounds the loss of a very large ratio on a negative advantage.
    Computed as the equal s = A * clamp(rho, lo_i, hi_i): min(rho A, clip(rho) A) is A * min(rho, clip_high)
    when A >= 0 and A * max(rho, clip_low) when A < 0 (where dual clip adds min(., c)), so one clamp with
    per-response bounds gives the value and a gradient that is exactly zero on the clipped branch.

    Args:
        rho: (B, T) ratios.
        advantages: (B,) A.
        clip_low, clip_high: ratio bounds, 0 <= clip_low <= 1 <= clip_high (may be inf).
        dual_clip_c: c > 1, or None for no dual clip.

    Returns:
        (B, T) surrogate s.
    """
    A = advantages[:, None].to(rho.dtype)  # (B, 1)
    negative = A < 0
    lo = torch.where(negative, clip_low, 0.0).to(rho.dtype)  # (B, 1)
    hi = torch.where(negative, math.inf if dual_clip_c is None else dual_clip_c, clip_high).to(rho.dtype)
    return A * rho.clamp(lo, hi)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref): k3 = exp(ref - l) - (ref - l) - 1 >= 0.

    Args:
        logprobs, ref_logprobs, response_mask: (B, T) l (carries the graph), ref, and the bool mask.

    Returns:
        (B, T) k3 in float32, 0 on padding; ref - l is clamped to +-LOG_RATIO_CLAMP like the log ratio.
    """
    d = torch.where(response_mask, ref_logprobs.float() - logprobs.float(), 0.0)
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0


def aggregate(
    values: Tensor,
    keep: Tensor,
    response_mask: Tensor,
    loss_agg: str,
    num_sequences: int | None = None,
    num_tokens: int | None = None,
) -> Tensor:
    """The one aggregation point of per-token loss terms.

    - `seq_mean_token_mean` (paper): (1/N) sum_i (1/T_i) sum_t m_{i,t} v_{i,t}.
    - `token_mean`: sum_{i,t} m_{i,t} v_{i,t} / sum_i T_i.

    T_i = response_mask[i].sum() counts every response token, kept or not; T_i = 0 contributes 0, not NaN.
    N and sum_i T_i default to this batch's; with the whole minibatch's totals as `num_sequences` /
    `num_tokens`, the results (and gradients) of its micro-batches or data-parallel ranks sum to the
    minibatch's exactly (a framework that averages gradients over ranks must be scaled by the world size).

    Args:
        values: (B, T) per-token values v.
        keep: (B, T) bool keep-mask m (intersected with response_mask here).
        response_mask: (B, T) bool, True on response tokens.
        loss_agg: one of `LOSS_AGGS`.
        num_sequences: N override (>= B).
        num_tokens: sum_i T_i override.

    Returns:
        Scalar tensor.
    """
    _check_name(loss_agg, LOSS_AGGS, "loss_agg")
    _check_mask(response_mask, values.shape)
    _check_mask(keep, values.shape, "keep")
    kept = torch.where(keep & response_mask, values, 0.0)  # where, not *, so garbage in padding cannot leak
    if loss_agg == "seq_mean_token_mean":
        # Rows without response tokens (e.g. dropped groups) add nothing and need not be counted in N;
        # the (host-syncing) count runs only when num_sequences is below B.
        if num_sequences is not None and num_sequences < values.shape[0]:
            live = int(response_mask.any(dim=1).sum())
            if num_sequences < live:
                raise ValueError(f"num_sequences={num_sequences} is below this batch's {live} responses")
        N = values.shape[0] if num_sequences is None else num_sequences
        T_i = response_mask.sum(dim=1).clamp(min=1)  # (B,); rows with T_i = 0 have a zero sum anyway
        return (kept.sum(dim=1) / T_i).sum() / max(N, 1)
    total = response_mask.sum().clamp(min=1) if num_tokens is None else max(num_tokens, 1)
    return kept.sum() / total


def _check_loss_args(logprobs, behavior_logprobs, advantages, response_mask, ref_logprobs, opts) -> None:
    B_T = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must have shape (B, T), got {tuple(B_T)}")
    if behavior_logprobs.shape != B_T or (ref_logprobs is not None and ref_logprobs.shape != B_T):
        raise ValueError(f"behavior_logprobs and ref_logprobs must have the shape of logprobs, {tuple(B_T)}")
    if advantages.shape != B_T[:1]:
        raise ValueError(f"advantages must have shape (B,) = ({B_T[0]},), got {tuple(advantages.shape)}")
    _check_mask(response_mask, B_T)
    _check_name(opts["nav_scope"], NAV_SCOPES, "nav_scope")
    _check_name(opts["loss_agg"], LOSS_AGGS, "loss_agg")
    if not 0 <= opts["clip_low"] <= 1 <= opts["clip_high"]:
        bounds = f"clip_low={opts['clip_low']}, clip_high={opts['clip_high']}"
        raise ValueError(f"ratio bounds need 0 <= clip_low <= 1 <= clip_high, got {bounds}")
    if opts["dual_clip_c"] is not None and not opts["dual_clip_c"] > 1:
        raise ValueError(f"dual_clip_c must be > 1 (or None to disable), got {opts['dual_clip_c']}")
    if not opts["kl_coef"] >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {opts['kl_coef']}")
    if opts["kl_coef"] > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (or set kl_coef=0)")


def policy_loss(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    nav_tau: float,
    nav_scope: str,
    loss_agg: str = "seq_mean_token_mean",
    dual_clip_c: float | None = None,
    m2po_threshold: float | None = None,
    kl_coef: float = 0.0,
    ref_logprobs: Tensor | None = None,
    num_sequences: int | None = None,
    num_tokens: int | None = None,
    m2po_keep: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """mu-GRPO policy loss L = -agg(m * s) (+ kl_coef * agg(k3)), one function for all presets.

    rho = exp(clamp(l - b)) in float32 whatever the input dtype; s = `clipped_surrogate`; m = `nav_mask` from
    the current ratios, & `m2po_mask` if m2po_threshold is set; `aggregate` applies `loss_agg`. GRPO: clip
    [0.8, 1.2], scope `none`; mu-GRPO: clip [0, 5], scope `sequence`, tau 1e-4. The KL penalty (k3) covers
    every response token (response_mask, not m: the veto is about the behaviour policy, KL about the
    reference), same aggregation; with ref_logprobs and kl_coef = 0, `kl` is reported, not added.

    Args:
        logprobs: (B, T) l = log pi_theta(a_t | ...), carries the graph; any float dtype.
        behavior_logprobs: (B, T) b from the rollout engine.
        advantages: (B,) A, one per response.
        response_mask: (B, T) bool, True on response tokens (padding may hold any value, even NaN).
        clip_low, clip_high: ratio bounds, 0 <= clip_low <= 1 <= clip_high (inf allowed).
        nav_tau, nav_scope: veto threshold tau and scope (see `nav_mask`).
        loss_agg, num_sequences, num_tokens: aggregation and minibatch totals (see `aggregate`).
        dual_clip_c, m2po_threshold: c > 1 and tau_M2 (see `clipped_surrogate`, `m2po_mask`), or None.
        kl_coef, ref_logprobs: k3 penalty weight and (B, T) reference log-probs (needed if kl_coef > 0).
        m2po_keep: (B, T) bool M2PO keep-mask computed by the caller over the whole minibatch (when this
            call sees only a micro-batch of it); replaces `m2po_mask` of this call's tokens.

    Returns:
        (loss, metrics): scalar float32 loss; python floats over response tokens: counts and sums that
        `merge_metrics` combines across micro-batches, and the fractions and means derived from them.
    """
    opts = {"clip_low": clip_low, "clip_high": clip_high, "dual_clip_c": dual_clip_c, "kl_coef": kl_coef}
    opts |= {"nav_scope": nav_scope, "loss_agg": loss_agg}
    _check_loss_args(logprobs, behavior_logprobs, advantages, response_mask, ref_logprobs, opts)
    mask = response_mask
    l = logprobs.float()
    A = advantages.detach().float()
    log_ratio = torch.where(mask, l - behavior_logprobs.detach().float(), 0.0)  # (B, T)
    rho = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    s = clipped_surrogate(rho, A, clip_low, clip_high, dual_clip_c)
    trig = _nav_triggers(log_ratio.detach(), A, mask, nav_tau)  # (B, T) Trig, shared with the metrics
    nav_keep = mask & ~_NAV_DROP[nav_scope](trig)  # = nav_mask(log_ratio, A, mask, nav_tau, nav_scope)
    if m2po_keep is not None:
        m2po_keep = m2po_keep & mask
    elif m2po_threshold is not None:
        m2po_keep = m2po_mask(log_ratio, mask, m2po_threshold)
    keep = nav_keep if m2po_keep is None else nav_keep & m2po_keep
    loss = -aggregate(s, keep, mask, loss_agg, num_sequences, num_tokens)
    k3 = None if ref_logprobs is None else kl_k3(l, ref_logprobs.detach(), mask)
    if k3 is not None and kl_coef > 0:
        loss = loss + kl_coef * aggregate(k3, mask, mask, loss_agg, num_sequences, num_tokens)
    counts = loss_counts(rho, A, mask, trig, nav_keep, m2po_keep, k3, loss, opts)
    return loss, derive(counts)


# Derived key: (numerator, denominator), 0.0 when the denominator is 0 for a fraction and NaN for a mean
# (no negative-advantage token: E[rho | A<0] is undefined, not 0). Metrics that are neither derived
