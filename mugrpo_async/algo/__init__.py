"""The algorithm, pure torch and importable without Ray: advantages, the veto and M2PO masks, the loss, its metrics.

Equations as in DESIGN.md ("The method, exactly"); tests: ``.venv/bin/python -m pytest tests/test_algo.py -q``.
"""

from mugrpo_async.algo.advantages import ADV_EPS, group_advantages, nonconstant_groups, overlong_penalty
from mugrpo_async.algo.diagnostics import (
    merge_metrics,
    merge_mismatch,
    mismatch_counts,
    mismatch_metrics,
    neg_adv_histogram,
)
from mugrpo_async.algo.loss import LossSpec, aggregate, clipped_surrogate, kl_k3, policy_loss, truncated_is_weight
from mugrpo_async.algo.masks import LOG_RATIO_CLAMP, m2po_mask, nav_mask
from mugrpo_async.choices import LOSS_AGGS, NAV_SCOPES

__all__ = [
    "ADV_EPS", "LOG_RATIO_CLAMP", "LOSS_AGGS", "NAV_SCOPES", "LossSpec", "aggregate", "clipped_surrogate",
    "group_advantages", "kl_k3", "m2po_mask", "merge_metrics", "merge_mismatch", "mismatch_counts", "mismatch_metrics",
    "nav_mask", "neg_adv_histogram", "nonconstant_groups", "overlong_penalty", "policy_loss", "truncated_is_weight",
]  # fmt: skip
