"""Diagnostics of the policy loss: additive counts per (micro-)batch, and the fractions and means derived from them.

`loss_counts` turns one call's tensors into python floats in one device transfer; `merge_metrics` combines the
counts of micro-batches or ranks into those of their union, so a minibatch's metrics do not depend on how it was
split. Pure torch, no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

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


def loss_counts(rho, A, mask, trig, nav_keep, m2po_keep, k3, loss, opts) -> dict[str, float]:
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


def derive(counts: Mapping[str, float]) -> dict[str, float]:
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
    return derive(counts)
