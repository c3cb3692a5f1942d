"""Group-normalised advantages (DESIGN.md, "The method, exactly"): A_i = (R_i - mean_g R) / (std_g R + 1e-6).

Shapes: `num_groups` prompt groups of `G` responses. Pure torch, no Ray.
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
