"""The token masks of the loss: the negative-advantage veto (NAV) and M2PO's second-moment trust region.

Shapes: `B` responses, `T` padded response length. Both run under no_grad: a mask is a function of the current
ratios, never differentiated. Pure torch, no Ray.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mugrpo_async.choices import NAV_SCOPES

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
def nav_mask(
    log_ratio: Tensor, advantages: Tensor, response_mask: Tensor, tau: float, scope: str, with_triggers: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
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
        with_triggers: also return Trig (for the loss's diagnostics, which count triggered responses).

    Returns:
        (B, T) bool keep-mask, also False on padding: keep = scope_keep & response_mask; with
        ``with_triggers``, the pair (keep, Trig).
    """
    _check_name(scope, NAV_SCOPES, "nav_scope")
    _check_mask(response_mask, log_ratio.shape)
    trig = _nav_triggers(log_ratio, advantages, response_mask, tau)  # (B, T)
    keep = response_mask & ~_NAV_DROP[scope](trig)
    return (keep, trig) if with_triggers else keep


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
