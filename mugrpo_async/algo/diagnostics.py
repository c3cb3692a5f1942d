"""Diagnostics of the policy loss: additive counts per (micro-)batch, and the fractions and means derived from them.

`loss_counts` turns one call's tensors into python floats in one device transfer; `merge_metrics` combines the
counts of micro-batches or ranks into those of their union, so a minibatch's metrics do not depend on how it was
split. Pure torch, no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from mugrpo_async.algo.masks import LOG_RATIO_CLAMP
from mugrpo_async.ratio_bins import HIST_DECADES, HIST_PER_DECADE, hist_bin_centre

_FRACTIONS = {
    "clip_frac": ("num_clipped", "num_tokens"),
    "nav_veto_frac": ("num_vetoed", "num_tokens"),
    "nav_trigger_seq_frac": ("num_trigger_seqs", "num_neg_adv_seqs"),
    "ratio_mean": ("ratio_sum", "num_tokens"),
    "ratio_mean_neg_adv": ("ratio_sum_neg_adv", "num_neg_adv_tokens"),
    "dual_clip_frac": ("num_dual_clipped", "num_tokens"),
    "m2po_mask_frac": ("num_m2po_masked", "num_tokens"),
    "kl": ("kl_sum", "num_tokens"),
    "tis_weight_mean": ("tis_weight_sum", "num_tokens"),
    "tis_truncated_frac": ("num_tis_truncated", "num_tokens"),
}
_FRACTIONS |= {
    "clip_frac_pos_adv": ("num_clipped_pos_adv", "num_pos_adv_tokens"),
    "clip_frac_neg_adv": ("num_clipped_neg_adv", "num_neg_adv_tokens"),
    "ratio_below_0p1_neg_adv_frac": ("num_ratio_below_0p1_neg_adv", "num_neg_adv_tokens"),
}
_MEANS = {"ratio_mean", "ratio_mean_neg_adv", "kl", "tis_weight_mean"}
_EXTREMA = {"ratio_min": min, "ratio_max": max}
_DERIVED = {*_FRACTIONS, "ratio_ess", "ratio_median_neg_adv"}

_HIST_EDGES = torch.linspace(*HIST_DECADES, (HIST_DECADES[1] - HIST_DECADES[0]) * HIST_PER_DECADE + 1,
                             dtype=torch.float64)  # fmt: skip
_HIST_KEYS = [f"hist_log_ratio_neg_adv_{k:03d}" for k in range(len(_HIST_EDGES) + 1)]


@torch.no_grad()
def _num_clipped(rho, rho_m, mask, pos, neg, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """Tokens whose clipped branch is active: (A > 0 and rho > clip_high, A < 0 and rho < clip_low).

    rho > 0 always, so a bound of 0 (below) or inf (above) clips nothing and its pass is skipped.
    """
    above = below = torch.zeros((), dtype=torch.int64, device=rho.device)
    if math.isfinite(clip_high):
        above = ((rho_m > clip_high).sum(dim=1) * pos).sum()
    if clip_low > 0:
        below = (((rho < clip_low) & mask).sum(dim=1) * neg).sum()
    return above, below


@torch.no_grad()
def _neg_adv_histogram(rho: Tensor, neg_tokens: Tensor) -> Tensor:
    """Counts of the negative-advantage tokens' log10 rho in the bins of :data:`HIST_DECADES` (no host sync)."""
    edges = _HIST_EDGES.to(rho.device)
    idx = torch.bucketize(torch.log10(rho.double()), edges, right=True).flatten()  # 0: below, len(edges): above
    return torch.zeros(len(edges) + 1, dtype=torch.float64, device=rho.device).scatter_add_(
        0, idx, neg_tokens.flatten().double()
    )


def neg_adv_histogram(counts: Mapping[str, float]) -> dict[str, float]:
    """The non-empty bins of the log10-ratio histogram of negative-advantage tokens, as ``{bin: tokens}``.

    Bin 0 holds rho < 1e-8, bin k (1..200) rho in [10^(-8 + (k - 1) / 20), 10^(-8 + k / 20)), bin 201 rho >= 100
    (:data:`HIST_DECADES`, :data:`HIST_PER_DECADE`). Sparse, since a minibatch fills a few dozen bins of 202.
    """
    return {str(k): counts[key] for k, key in enumerate(_HIST_KEYS) if counts.get(key, 0.0) > 0}


def _median_from_histogram(counts: Mapping[str, float]) -> float:
    """The ratio at the middle negative-advantage token, as the geometric centre of its bin (NaN without any)."""
    hist = [counts[k] for k in _HIST_KEYS]
    total = math.fsum(hist)
    if total <= 0:
        return math.nan
    run = 0.0
    for k, c in enumerate(hist):
        run += c
        if run >= total / 2:
            return 10.0 ** hist_bin_centre(k)
    return math.nan


class LossMasks(NamedTuple):
    """The (B, T) bool masks of one loss call: response tokens, NAV triggers, the veto's keep, M2PO's (or None)."""

    response: Tensor
    triggers: Tensor
    nav_keep: Tensor
    m2po_keep: Tensor | None


def loss_counts(rho: Tensor, A: Tensor, masks: LossMasks, k3: Tensor | None, tis_w: Tensor | None, loss: Tensor,
                spec) -> dict[str, float]:  # fmt: skip
    """Additive statistics over response tokens, from per-response (B,) sums, in one device transfer.

    Args:
        rho: (B, T) ratios; A: (B,) advantages; masks: the call's masks; k3: (B, T) KL terms or None; tis_w: (B, T)
            truncated importance weights or None; loss: the scalar loss; spec: the `LossSpec`.

    (B,) vectors are weighted by the 0/1 row masks rather than indexed by them: boolean indexing would make
    the host wait for the device at every step.
    """
    mask, trig, nav_keep, m2po_keep = masks
    mask_f = mask.to(rho.dtype)
    rho_m = rho * mask_f  # (B, T), 0 on padding (rho is finite there: exp(0))
    neg, pos = A < 0, A > 0  # (B,)
    T_i, row_sum = mask.sum(dim=1), rho_m.sum(dim=1)  # (B,)
    n = T_i.sum()
    flat = rho_m.flatten()
    clipped = _num_clipped(rho, rho_m, mask, pos, neg, spec.clip_low, spec.clip_high)
    stats = {
        "loss": loss.detach(),
        "num_tokens": n,
        "num_clipped": clipped[0] + clipped[1],
        "num_clipped_pos_adv": clipped[0],
        "num_clipped_neg_adv": clipped[1],
        "num_pos_adv_tokens": (T_i * pos).sum(),
        "num_ratio_below_0p1_neg_adv": (((rho < 0.1) & mask).sum(dim=1) * neg).sum(),
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
    if spec.dual_clip_c is not None:
        stats["num_dual_clipped"] = ((rho_m > spec.dual_clip_c).sum(dim=1) * neg).sum()
    if m2po_keep is not None:
        stats["num_m2po_masked"] = n - m2po_keep.sum()
    if k3 is not None:
        stats["kl_sum"] = k3.sum()  # k3 is 0 on padding
    if tis_w is not None:  # 1 on padding
        stats |= {
            "tis_weight_sum": (tis_w * mask_f).double().sum(),
            "num_tis_truncated": ((tis_w >= spec.tis_cap) & mask).sum(),
        }
    hist = _neg_adv_histogram(rho, mask & neg[:, None])
    values = torch.cat([torch.stack([v.to(device=loss.device, dtype=torch.float64) for v in stats.values()]),
                        hist.to(loss.device)]).tolist()  # fmt: skip
    counts = dict(zip([*stats, *_HIST_KEYS], values))
    counts["num_sequences"] = float(mask.shape[0])
    return counts


def derive(counts: Mapping[str, float]) -> dict[str, float]:
    """Fractions and means from additive counts; the same code for one batch and for merged ones."""
    out = dict(counts)
    for key, (num, den) in _FRACTIONS.items():
        if num in counts:
            out[key] = counts[num] / counts[den] if counts[den] > 0 else (math.nan if key in _MEANS else 0.0)
    n, s1, s2 = counts["num_tokens"], counts["ratio_sum"], counts["ratio_sq_sum"]
    # Normalised effective sample size of the ratios, in (0, 1]; 0.0 without response tokens.
    out["ratio_ess"] = s1 * s1 / (n * s2) if n > 0 and s2 > 0 else 0.0
    out["ratio_median_neg_adv"] = _median_from_histogram(counts)
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
    return derive(counts)


@torch.no_grad()
def mismatch_counts(logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """Train/inference mismatch on tokens where the trainer holds the behaviour weights: additive counts.

    With d = l - b (trainer minus engine log-prob of the sampled token, same weights): the number of tokens,
    sum |d|, max |d| and the sum of k3 = exp(d) - 1 - d, an unbiased estimate of KL(engine || trainer) per token
    under the engine's samples (>= 0). `mismatch_metrics` turns merged counts into the reported metrics.

    Args:
        logprobs, behavior_logprobs: (B, T) l (the trainer's, before its step) and b (the engine's).
        mask: (B, T) bool, the tokens to count (response tokens of rows generated by the current weights).
    """
    d = torch.where(mask, logprobs.detach().float() - behavior_logprobs.float(), 0.0)
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    stats = torch.stack([mask.sum().double(), d.abs().double().sum(), d.abs().amax().double() if d.numel() else
                         torch.zeros((), dtype=torch.float64), (torch.expm1(d) - d).double().sum()])  # fmt: skip
    n, abs_sum, abs_max, k3_sum = stats.tolist()
    return {"mismatch_tokens": n, "mismatch_abs_sum": abs_sum, "mismatch_abs_max": abs_max, "mismatch_k3_sum": k3_sum}


def merge_mismatch(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """`mismatch_counts` of micro-batches or ranks combined: sums, and the max of the maxima."""
    out = {k: math.fsum(p[k] for p in parts) for k in ("mismatch_tokens", "mismatch_abs_sum", "mismatch_k3_sum")}
    out["mismatch_abs_max"] = max((p["mismatch_abs_max"] for p in parts), default=0.0)
    return out


def mismatch_metrics(counts: Mapping[str, float]) -> dict[str, float]:
    """`mismatch_logprob_abs_mean`, `mismatch_logprob_abs_max`, `mismatch_kl` (k3) from merged counts; {} if none."""
    n = counts.get("mismatch_tokens", 0.0)
    if n <= 0:
        return {}
    return {"mismatch_logprob_abs_mean": counts["mismatch_abs_sum"] / n,
            "mismatch_logprob_abs_max": counts["mismatch_abs_max"], "mismatch_kl": counts["mismatch_k3_sum"] / n,
            "mismatch_tokens": n}  # fmt: skip
