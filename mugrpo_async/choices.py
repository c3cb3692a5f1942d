"""Names shared by the config schema and the algorithm core.

This module imports nothing heavy (no torch), so the config module can validate
`algo.nav_scope` and `algo.loss_agg` without importing the loss code.
"""

NAV_SCOPES: tuple[str, ...] = ("none", "trigger", "suffix", "suffix_nontrigger", "sequence")
"""Scopes of the negative-advantage veto; see `mugrpo_async.algo.nav_mask`."""

LOSS_AGGS: tuple[str, ...] = ("seq_mean_token_mean", "token_mean")
"""Loss aggregations; see `mugrpo_async.algo.aggregate`."""
