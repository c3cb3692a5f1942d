"""The mu-GRPO policy loss: ratios, clipping, the veto and M2PO masks applied, one aggregation point, KL.

Equations as in DESIGN.md ("The method, exactly"). Shapes: `B` responses in a (micro-)batch, `T` padded
response length, `G` responses per prompt group. No Ray, no model code; runs on any device. Tests:

    .venv/bin/python -m pytest tests/test_algo.py -q
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from mugrpo_async.algo.diagnostics import LossMasks, derive, loss_counts
from mugrpo_async.algo.masks import LOG_RATIO_CLAMP, _check_mask, _check_name, m2po_mask, nav_mask
from mugrpo_async.choices import LOSS_AGGS, NAV_SCOPES


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
    norm_len: int | None = None,
) -> Tensor:
    """The one aggregation point of per-token loss terms.

    - `seq_mean_token_mean` (paper): (1/N) sum_i (1/T_i) sum_t m_{i,t} v_{i,t}.
    - `token_mean`: sum_{i,t} m_{i,t} v_{i,t} / sum_i T_i.
    - `seq_mean_token_sum_norm` (Dr. GRPO, arXiv:2503.20783): (1/N) sum_i (1/L) sum_t m_{i,t} v_{i,t} with the
      constant L = ``norm_len`` (the response length limit), so a response's weight does not depend on its length.

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
        norm_len: L of `seq_mean_token_sum_norm` (default: this batch's padded length T, as verl's; give the
            constant response limit so that micro-batches sum to the minibatch).

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
    if loss_agg == "seq_mean_token_sum_norm":
        N = values.shape[0] if num_sequences is None else num_sequences
        L = values.shape[1] if norm_len is None else norm_len
        return kept.sum() / max(L, 1) / max(N, 1)
    total = response_mask.sum().clamp(min=1) if num_tokens is None else max(num_tokens, 1)
    return kept.sum() / total


@dataclass(frozen=True)
class LossSpec:
    """Every option of the policy loss, validated once (a frozen value, built from the config by `from_config`).

    Attributes:
        clip_low, clip_high: ratio bounds, 0 <= clip_low <= 1 <= clip_high (clip_high may be inf).
        nav_tau, nav_scope: veto threshold tau >= 0 and scope (one of `NAV_SCOPES`, see `nav_mask`).
        loss_agg: one of `LOSS_AGGS` (see `aggregate`).
        dual_clip_c: c > 1 for dual clip on A < 0, or None.
        m2po_threshold: tau_M2 >= 0 for M2PO's second-moment mask, or None.
        kl_coef: weight >= 0 of the k3 penalty against the reference policy.
        tis_cap: C >= 1 for truncated importance sampling on the train/inference mismatch, or None (see
            `policy_loss`).
        norm_len: L >= 1 of `seq_mean_token_sum_norm` (the response length limit), or None (see `aggregate`).
    """

    clip_low: float
    clip_high: float
    nav_tau: float
    nav_scope: str
    loss_agg: str = "seq_mean_token_mean"
    dual_clip_c: float | None = None
    m2po_threshold: float | None = None
    kl_coef: float = 0.0
    tis_cap: float | None = None
    norm_len: int | None = None

    def __post_init__(self) -> None:
        _check_name(self.nav_scope, NAV_SCOPES, "nav_scope")
        _check_name(self.loss_agg, LOSS_AGGS, "loss_agg")
        if not 0 <= self.clip_low <= 1 <= self.clip_high:
            bounds = f"clip_low={self.clip_low}, clip_high={self.clip_high}"
            raise ValueError(f"ratio bounds need 0 <= clip_low <= 1 <= clip_high, got {bounds}")
        if not self.nav_tau >= 0:
            raise ValueError(f"nav_tau must be >= 0, got {self.nav_tau}")
        checks = {"dual_clip_c": (self.dual_clip_c, "> 1", lambda x: x > 1),
                  "m2po_threshold": (self.m2po_threshold, ">= 0", lambda x: x >= 0),
                  "tis_cap": (self.tis_cap, ">= 1", lambda x: x >= 1)}  # fmt: skip
        for name, (value, rule, ok) in checks.items():
            if value is not None and not (math.isfinite(value) and ok(value)):
                raise ValueError(f"{name} must be finite and {rule} (or None to disable), got {value}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"kl_coef must be finite and >= 0, got {self.kl_coef}")
        if self.norm_len is not None and self.norm_len < 1:
            raise ValueError(f"norm_len must be >= 1 (or None), got {self.norm_len}")

    @classmethod
    def from_config(cls, algo, max_new_tokens: int | None = None) -> LossSpec:
        """The spec of a validated ``AlgoConfig`` (presets already applied); ``max_new_tokens`` (the rollout's
        response limit) is `seq_mean_token_sum_norm`'s constant L."""
        own = {f.name: getattr(algo, f.name) for f in fields(cls) if f.name != "norm_len"}
        return cls(**own, norm_len=max_new_tokens)


def _check_loss_args(logprobs, behavior_logprobs, advantages, response_mask, spec: LossSpec, extra: dict) -> None:
    B_T = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must have shape (B, T), got {tuple(B_T)}")
    if behavior_logprobs.shape != B_T or any(v is not None and v.shape != B_T for v in extra.values()):
        names = ", ".join(["behavior_logprobs", *extra])
        raise ValueError(f"{names} must have the shape of logprobs, {tuple(B_T)}")
    if advantages.shape != B_T[:1]:
        raise ValueError(f"advantages must have shape (B,) = ({B_T[0]},), got {tuple(advantages.shape)}")
    _check_mask(response_mask, B_T)
    if spec.kl_coef > 0 and extra["ref_logprobs"] is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (or set kl_coef=0)")
    if (spec.tis_cap is None) != (extra["trainer_behavior_logprobs"] is None):
        raise ValueError("tis_cap and trainer_behavior_logprobs go together (both set, or neither)")


def _loss_masks(log_ratio: Tensor, A: Tensor, mask: Tensor, spec: LossSpec, m2po_keep: Tensor | None) -> LossMasks:
    """The veto's keep-mask and triggers from the current ratios, and M2PO's (given, or of these tokens)."""
    nav_keep, trig = nav_mask(log_ratio, A, mask, spec.nav_tau, spec.nav_scope, with_triggers=True)
    if m2po_keep is not None:
        m2po_keep = m2po_keep & mask
    elif spec.m2po_threshold is not None:
        m2po_keep = m2po_mask(log_ratio, mask, spec.m2po_threshold)
    return LossMasks(mask, trig, nav_keep, m2po_keep)


def _resolve_spec(spec: LossSpec | None, options: dict) -> LossSpec:
    if spec is not None and options:
        raise TypeError(f"pass either spec or loss options, not both (got {sorted(options)})")
    return spec if spec is not None else LossSpec(**options)


def policy_loss(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    spec: LossSpec | None = None,
    *,
    ref_logprobs: Tensor | None = None,
    trainer_behavior_logprobs: Tensor | None = None,
    num_sequences: int | None = None,
    num_tokens: int | None = None,
    m2po_keep: Tensor | None = None,
    **options,
) -> tuple[Tensor, dict[str, float]]:
    """mu-GRPO policy loss L = -agg(m * w * s) (+ kl_coef * agg(k3)), one function for all presets.

    rho = exp(clamp(l - b)) in float32 whatever the input dtype; s = `clipped_surrogate`; m = `nav_mask` from the
    current ratios, & `m2po_mask` if set; `aggregate` applies `loss_agg`; w = 1. GRPO: clip [0.8, 1.2], scope
    `none`; mu-GRPO: clip [0, 5], scope `sequence`, tau 1e-4. The KL penalty (k3) covers every response token (the
    veto is about the behaviour policy, KL about the reference); with kl_coef = 0 it is reported, not added.

    Truncated importance sampling (``tis_cap`` = C, as verl's rollout correction and OpenRLHF's and TRL's vLLM IS
    correction): with b_trainer the trainer's own log-probs under the behaviour weights, rho = exp(l - b_trainer)
    and each token's surrogate is weighted by w = min(exp(b_trainer - b), C), detached.

    Args:
        logprobs: (B, T) l = log pi_theta(a_t | ...), carries the graph; any float dtype.
        behavior_logprobs: (B, T) b from the rollout engine.
        advantages: (B,) A, one per response.
        response_mask: (B, T) bool, True on response tokens (padding may hold any value, even NaN).
        spec: the loss options as a `LossSpec`; or pass its fields as keyword ``options`` (clip_low, clip_high,
            nav_tau, nav_scope, loss_agg, dual_clip_c, m2po_threshold, kl_coef, tis_cap, norm_len), not both.
        ref_logprobs: (B, T) reference log-probs (needed if kl_coef > 0).
        trainer_behavior_logprobs: (B, T) b_trainer (needed if tis_cap is set).
        num_sequences, num_tokens: minibatch totals (see `aggregate`).
        m2po_keep: (B, T) bool M2PO keep-mask of the whole minibatch's pass (this call sees a micro-batch).

    Returns:
        (loss, metrics): scalar float32 loss; python floats over response tokens: counts and sums that
        `merge_metrics` combines across micro-batches, and the fractions and means derived from them.
    """
    spec = _resolve_spec(spec, options)
    extra = {"ref_logprobs": ref_logprobs, "trainer_behavior_logprobs": trainer_behavior_logprobs}
    _check_loss_args(logprobs, behavior_logprobs, advantages, response_mask, spec, extra)
    mask, l, A = response_mask, logprobs.float(), advantages.detach().float()
    base = behavior_logprobs if trainer_behavior_logprobs is None else trainer_behavior_logprobs
    log_ratio = torch.where(mask, l - base.detach().float(), 0.0)  # (B, T) log rho
    rho = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    s = clipped_surrogate(rho, A, spec.clip_low, spec.clip_high, spec.dual_clip_c)
    tis_w = None
    if trainer_behavior_logprobs is not None:
        tis_w = truncated_is_weight(trainer_behavior_logprobs, behavior_logprobs, mask, spec.tis_cap)
        s = s * tis_w
    masks = _loss_masks(log_ratio, A, mask, spec, m2po_keep)
    keep = masks.nav_keep if masks.m2po_keep is None else masks.nav_keep & masks.m2po_keep
    loss = -aggregate(s, keep, mask, spec.loss_agg, num_sequences, num_tokens, spec.norm_len)
    k3 = None if ref_logprobs is None else kl_k3(l, ref_logprobs.detach(), mask)
    if k3 is not None and spec.kl_coef > 0:
        loss = loss + spec.kl_coef * aggregate(k3, mask, mask, spec.loss_agg, num_sequences, num_tokens, spec.norm_len)
    return loss, derive(loss_counts(rho, A, masks, k3, tis_w, loss, spec))


@torch.no_grad()
def truncated_is_weight(trainer_logprobs: Tensor, engine_logprobs: Tensor, response_mask: Tensor, cap: float) -> Tensor:
    """w = min(exp(b_trainer - b_engine), C) per token, float32, 1 on padding (detached, never differentiated).

    Args:
        trainer_logprobs, engine_logprobs: (B, T) the trainer's and the engine's log-probs of the sampled tokens
            under the same (behaviour) weights.
        response_mask: (B, T) bool.
        cap: C >= 1.

    Returns:
        (B, T) weights in (0, C].
    """
    d = torch.where(response_mask, trainer_logprobs.float() - engine_logprobs.float(), 0.0)
    return torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=cap)
