"""Pure-torch core of mu-GRPO: group advantages, ratios, clipping, the negative-advantage veto, M2PO, loss.

Equations as in DESIGN.md ("The method, exactly"). Shapes: `B` responses in a (micro-)batch, `T` padded
response length, `G` responses per prompt group. No Ray, no model code; runs on any device. Tests:

    .venv/bin/python -m pytest tests/test_algo.py -q
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from mugrpo_async.constants import LOSS_AGGS, NAV_SCOPES

__all__ = [
    "LOSS_AGGS", "NAV_SCOPES", "aggregate", "clipped_surrogate", "group_advantages", "kl_k3", "m2po_mask",
    "merge_metrics", "nav_mask", "nonconstant_groups", "policy_loss",
]  # fmt: skip

ADV_EPS = 1e-6  # added to the group std in `group_advantages`

LOG_RATIO_CLAMP = 20.0
"""Bound on |l - b| (and |ref - l|) before `exp`: exp(20) ~ 4.9e8 keeps rho * A, rho**2 and their sums over
millions of tokens finite in float32 for log ratios of +-50 or +-inf. Inside the bound the clamp is the
identity, gradient included; beyond it the token's gradient is zero (ratios no trust region lets through)."""


def _check_name(value: str, valid: tuple[str, ...], key: str) -> None:
    if value not in valid:
        raise ValueError(f"unknown {key} {value!r}; valid: {', '.join(valid)}")


def _check_mask(mask: Tensor, shape: torch.Size, name: str = "response_mask") -> None:
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {mask.dtype}")
    if mask.shape != shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(shape)}")


def nonconstant_groups(rewards: Tensor) -> Tensor:
    """Which prompt groups carry signal, i.e. do not have all rewards equal.

    Args:
        rewards: (num_groups, G) rewards R.

    Returns:
        (num_groups,) bool, True where some R differs within the group: the row mask for callers that drop
        constant groups (all-zero advantages) and count them.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape (num_groups, G), got {tuple(rewards.shape)}")
    return (rewards != rewards[:, :1]).any(dim=1)


def group_advantages(rewards: Tensor) -> Tensor:
    """Group-normalised advantages A_i = (R_i - mean_g R) / (std_g R + 1e-6).

    std is the unbiased one (torch's default, as TRL and verl). A group whose rewards are all equal (this
    includes G = 1) gets advantages of exactly 0.0, not rounding noise from R - mean_g R.

    Args:
        rewards: (num_groups, G) rewards R; any real dtype.

    Returns:
        (num_groups, G) advantages A, float32 (float64 if the rewards are float64).
    """
    signal = nonconstant_groups(rewards)  # (num_groups,)
    R = rewards.double() if rewards.dtype == torch.float64 else rewards.float()
    if R.shape[1] < 2:
        return torch.zeros_like(R)
    A = (R - R.mean(dim=1, keepdim=True)) / (R.std(dim=1, keepdim=True) + ADV_EPS)
    return torch.where(signal[:, None], A, torch.zeros_like(A))


def _nav_triggers(log_ratio: Tensor, advantages: Tensor, response_mask: Tensor, tau: float) -> Tensor:
    """(B, T) bool Trig: response tokens of A_i < 0 responses with rho < tau, tested as log rho < log tau."""
    if advantages.shape != log_ratio.shape[:1]:
        raise ValueError(f"advantages must have shape (B,), got {tuple(advantages.shape)}")
    if not tau >= 0:
        raise ValueError(f"nav_tau must be >= 0, got {tau}")
    log_tau = math.log(tau) if tau > 0 else -math.inf
    if log_ratio.dtype != torch.float64:
        # torch compares with the scalar rounded to float32; rounding log tau up to the next float32
        # instead makes `x < log_tau32` hold exactly when x < log tau, for every float32 x.
        log_ratio = log_ratio.float()
        t = torch.tensor(log_tau, dtype=torch.float32)
        log_tau = (torch.nextafter(t, torch.tensor(math.inf)) if t.item() < log_tau else t).item()
    negative = (advantages < 0)[:, None]  # (B, 1)
    return response_mask & negative & (log_ratio < log_tau)


def _after_kappa(trig: Tensor) -> Tensor:
    """(B, T) bool [t > kappa_i]: a trigger at some position < t, i.e. inclusive trigger count > trig_t."""
    return torch.cumsum(trig, dim=1, dtype=torch.int32) > trig.to(torch.int32)


# Dropped set of each scope as a function of Trig (B, T); "sequence" gives (B, 1) and broadcasts.
_NAV_DROP = {
    "none": torch.zeros_like,
    "trigger": lambda trig: trig,
    "suffix": _after_kappa,
    "suffix_nontrigger": lambda trig: _after_kappa(trig) & ~trig,
    "sequence": lambda trig: trig.any(dim=1, keepdim=True),
}
assert tuple(_NAV_DROP) == NAV_SCOPES


@torch.no_grad()
def nav_mask(log_ratio: Tensor, advantages: Tensor, response_mask: Tensor, tau: float, scope: str) -> Tensor:
    """Negative-advantage veto (NAV): the keep-mask m of the mu-GRPO loss.

    Only responses with A_i < 0 are touched. Trig_i = {t : response token, rho_{i,t} < tau} with
    rho = exp(log_ratio); padding never triggers. kappa_i = min Trig_i (none if Trig_i is empty).
    Dropped tokens by scope:

    - `none`: nothing.
    - `trigger`: t in Trig_i.
    - `suffix`: t > kappa_i (the trigger token at kappa_i itself is kept).
    - `suffix_nontrigger`: t > kappa_i and t not in Trig_i.
    - `sequence`: every token of response i if Trig_i is non-empty.

    Args:
        log_ratio: (B, T) log rho = l - b; read without gradient.
        advantages: (B,) A.
        response_mask: (B, T) bool, True on response tokens, False on padding.
        tau: trigger threshold on rho (>= 0; 0 disables triggers).
        scope: one of `NAV_SCOPES`.

    Returns:
        (B, T) bool keep-mask, also False on padding: keep = scope_keep & response_mask.
    """
    _check_name(scope, NAV_SCOPES, "nav_scope")
    _check_mask(response_mask, log_ratio.shape)
    trig = _nav_triggers(log_ratio, advantages, response_mask, tau)  # (B, T)
    return response_mask & ~_NAV_DROP[scope](trig)


@torch.no_grad()
def m2po_mask(log_ratio: Tensor, response_mask: Tensor, threshold: float) -> Tensor:
    """M2PO second-moment trust region (Zheng et al. 2025, arXiv:2510.01161).

    With M2_{i,t} = (l - b)^2 = (log rho_{i,t})^2, mask response tokens greedily, largest M2 first, until
    mean(M2 over the remaining response tokens) <= threshold. The mean of the n - k smallest values does not
    grow with k, so the number masked is the count of k in [0, n) with sum(n - k smallest) > threshold *
    (n - k): one sort and one reverse cumulative sum.

    Details followed: the mean is over the unmasked (response) tokens passed in, i.e. the minibatch, or a
    micro-batch if the caller splits one; masking applies to all tokens regardless of advantage sign; no
    clipping beyond the configured clip bounds. Ties are broken by sort order.

    Args:
        log_ratio: (B, T) log rho; read without gradient.
        response_mask: (B, T) bool, True on response tokens.
        threshold: tau_M2 >= 0 (0.04 in the M2PO presets).

    Returns:
        (B, T) bool keep-mask, False on masked tokens and on padding.
    """
    _check_mask(response_mask, log_ratio.shape)
    if not threshold >= 0:
        raise ValueError(f"m2po_threshold must be >= 0, got {threshold}")
    valid = response_mask.flatten()  # (B*T,)
    m2 = torch.where(valid, log_ratio.flatten().double().square(), -1.0)  # padding sorts last
    m2_sorted, order = torch.sort(m2, descending=True)
    valid_sorted = m2_sorted >= 0
    # rest_sum[k], rest_count[k]: sum and count of response tokens left after masking the k largest.
    rest_sum = torch.where(valid_sorted, m2_sorted, 0.0).flip(0).cumsum(0).flip(0)
    rest_count = valid_sorted.flip(0).cumsum(0).flip(0)
    k_star = ((rest_sum > threshold * rest_count.double()) & (rest_count > 0)).sum()
    drop_sorted = torch.arange(m2.numel(), device=m2.device) < k_star
    drop = torch.empty_like(valid).scatter_(0, order, drop_sorted)
    return response_mask & ~drop.view_as(response_mask)


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
    counts = _loss_counts(rho, A, mask, trig, nav_keep, m2po_keep, k3, loss, opts)
    return loss, _derive(counts)


# Derived key: (numerator, denominator), 0.0 when the denominator is 0 for a fraction and NaN for a mean
# (no negative-advantage token: E[rho | A<0] is undefined, not 0). Metrics that are neither derived
# nor in _EXTREMA are additive: loss, num_* counts, ratio_sum, ratio_sq_sum, ratio_sum_neg_adv, kl_sum.
_FRACTIONS = {
    "clip_frac": ("num_clipped", "num_tokens"),
    "nav_veto_frac": ("num_vetoed", "num_tokens"),
    "nav_trigger_seq_frac": ("num_trigger_seqs", "num_neg_adv_seqs"),
    "ratio_mean": ("ratio_sum", "num_tokens"),
    "ratio_mean_neg_adv": ("ratio_sum_neg_adv", "num_neg_adv_tokens"),
    "dual_clip_frac": ("num_dual_clipped", "num_tokens"),
    "m2po_mask_frac": ("num_m2po_masked", "num_tokens"),
    "kl": ("kl_sum", "num_tokens"),
}
_MEANS = {"ratio_mean", "ratio_mean_neg_adv", "kl"}
_EXTREMA = {"ratio_min": min, "ratio_max": max}
_DERIVED = {*_FRACTIONS, "ratio_ess"}


@torch.no_grad()
def _num_clipped(rho, rho_m, mask, pos, neg, clip_low: float, clip_high: float) -> Tensor:
    """Tokens whose clipped branch is active: A > 0 and rho > clip_high, or A < 0 and rho < clip_low.

    rho > 0 always, so a bound of 0 (below) or inf (above) clips nothing and its pass is skipped.
    """
    total = torch.zeros((), dtype=torch.int64, device=rho.device)
    if math.isfinite(clip_high):
        total = total + ((rho_m > clip_high).sum(dim=1) * pos).sum()
    if clip_low > 0:
        total = total + (((rho < clip_low) & mask).sum(dim=1) * neg).sum()
    return total


def _loss_counts(rho, A, mask, trig, nav_keep, m2po_keep, k3, loss, opts) -> dict[str, float]:
    """Additive statistics over response tokens, from per-response (B,) sums, in one device transfer.

    (B,) vectors are weighted by the 0/1 row masks rather than indexed by them: boolean indexing would make
    the host wait for the device at every step.
    """
    mask_f = mask.to(rho.dtype)
    rho_m = rho * mask_f  # (B, T), 0 on padding (rho is finite there: exp(0))
    neg, pos = A < 0, A > 0  # (B,)
    T_i, row_sum = mask.sum(dim=1), rho_m.sum(dim=1)  # (B,)
    n = T_i.sum()
    flat = rho_m.flatten()
    stats = {
        "loss": loss.detach(),
        "num_tokens": n,
        "num_clipped": _num_clipped(rho, rho_m, mask, pos, neg, opts["clip_low"], opts["clip_high"]),
        "num_vetoed": n - nav_keep.sum(),
        "num_neg_adv_seqs": neg.sum(),
        "num_trigger_seqs": trig.any(dim=1).sum(),
        "num_neg_adv_tokens": (T_i * neg).sum(),
        "ratio_sum": row_sum.double().sum(),
        "ratio_sq_sum": torch.dot(flat, flat),
        "ratio_sum_neg_adv": (row_sum.double() * neg).sum(),
    }  # fmt: skip
    if rho.numel():  # amax refuses empty tensors; _derive reports NaN without response tokens
        # rho > 0, so padding (0 in rho_m, inf in the where) never wins the max or the min.
        stats |= {"ratio_min": torch.where(mask, rho, math.inf).amin(), "ratio_max": rho_m.amax()}
    if opts["dual_clip_c"] is not None:
        stats["num_dual_clipped"] = ((rho_m > opts["dual_clip_c"]).sum(dim=1) * neg).sum()
    if m2po_keep is not None:
        stats["num_m2po_masked"] = n - m2po_keep.sum()
    if k3 is not None:
        stats["kl_sum"] = k3.sum()  # k3 is 0 on padding
    values = torch.stack([v.to(device=loss.device, dtype=torch.float64) for v in stats.values()])
    counts = dict(zip(stats, values.tolist()))
    counts["num_sequences"] = float(mask.shape[0])
    return counts


def _derive(counts: Mapping[str, float]) -> dict[str, float]:
    """Fractions and means from additive counts; the same code for one batch and for merged ones."""
    out = dict(counts)
    for key, (num, den) in _FRACTIONS.items():
        if num in counts:
            out[key] = counts[num] / counts[den] if counts[den] > 0 else (math.nan if key in _MEANS else 0.0)
    n, s1, s2 = counts["num_tokens"], counts["ratio_sum"], counts["ratio_sq_sum"]
    # Normalised effective sample size of the ratios, in (0, 1]; 0.0 without response tokens.
    out["ratio_ess"] = s1 * s1 / (n * s2) if n > 0 and s2 > 0 else 0.0
    if n == 0:  # min / max undefined without response tokens: NaN, which merge_metrics skips
        out |= dict.fromkeys(_EXTREMA, math.nan)
    return out


def merge_metrics(metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Combine `policy_loss` metrics of micro-batches (or ranks) into those of their union.

    Counts and `loss` are summed (the minibatch loss when the parts used the minibatch totals
    `num_sequences` / `num_tokens`), `ratio_min` / `ratio_max` take the min / max, and every fraction and
    mean is recomputed from the sums.

    Args:
        metrics: non-empty list of metric dicts, all from the same loss options.

    Returns:
        One metric dict with the same keys.
    """
    if not metrics:
        raise ValueError("merge_metrics needs at least one metrics dict")
    keys = set(metrics[0])
    if any(set(m) != keys for m in metrics):
        raise ValueError("merge_metrics: metric dicts have different keys (different loss options?)")
    counts = {k: math.fsum(m[k] for m in metrics) for k in keys - _DERIVED - set(_EXTREMA)}
    for key, pick in _EXTREMA.items():  # NaN marks a part without response tokens
        counts[key] = pick((m[key] for m in metrics if not math.isnan(m[key])), default=math.nan)
    return _derive(counts)
