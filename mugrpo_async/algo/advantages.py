"""Group-normalised advantages (DESIGN.md, "The method, exactly"): A_i = (R_i - mean_g R) / (std_g R + 1e-6).

Options beside the paper's rule, each off by default: Dr. GRPO's advantages without the std normalisation
(Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783), and DAPO's soft overlong penalty
added to the reward (Yu et al. 2025, arXiv:2503.14476, eq. 13). Shapes: `num_groups` prompt groups of `G`
responses. Pure torch, no Ray.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADV_EPS = 1e-6  # added to the group std in `group_advantages`


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


def group_advantages(rewards: Tensor, std_norm: bool = True) -> Tensor:
    """Group-normalised advantages A_i = (R_i - mean_g R) / (std_g R + 1e-6).

    std is the unbiased one (torch's default, as TRL and verl). A group whose rewards are all equal (this
    includes G = 1) gets advantages of exactly 0.0, not rounding noise from R - mean_g R.

    Args:
        rewards: (num_groups, G) rewards R; any real dtype.
        std_norm: False for Dr. GRPO's A_i = R_i - mean_g R (``algo.advantage_std_norm``).

    Returns:
        (num_groups, G) advantages A, float32 (float64 if the rewards are float64).
    """
    signal = nonconstant_groups(rewards)  # (num_groups,)
    R = rewards.double() if rewards.dtype == torch.float64 else rewards.float()
    if R.shape[1] < 2:
        return torch.zeros_like(R)
    A = R - R.mean(dim=1, keepdim=True)
    if std_norm:
        A = A / (R.std(dim=1, keepdim=True) + ADV_EPS)
    return torch.where(signal[:, None], A, torch.zeros_like(A))


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int) -> Tensor:
    """DAPO's soft overlong penalty per response, added to its reward.

    With L_max = ``max_tokens`` and L_b = ``buffer``: 0 for T <= L_max - L_b, then ((L_max - L_b) - T) / L_b,
    linear from 0 down to -1 at T = L_max, and -1 beyond.

    Args:
        lengths: (...) response lengths T in tokens.
        max_tokens: L_max >= 1, the response length limit.
        buffer: L_b, 1 <= L_b <= L_max.

    Returns:
        (...) float32 penalties in [-1, 0].
    """
    if not 1 <= buffer <= max_tokens:
        raise ValueError(f"overlong buffer must be in [1, max_tokens={max_tokens}], got {buffer}")
    over = lengths.float() - (max_tokens - buffer)  # tokens into the buffer
    return -(over / buffer).clamp(0.0, 1.0)
