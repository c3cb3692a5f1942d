"""The named choices of the config, each listed once.

The config schema builds its ``Literal`` types from these tuples (and from the names of
:data:`ALGO_PRESETS`), and every module that owns behaviour per name asserts at import that its table covers
exactly its tuple: the veto's scopes (`mugrpo_async.algo.masks`), the loaders' row formats, the prompt
templates, the benchmark registry, the dry run's dtype sizes. The CLIs' ``--mode`` and ``--template`` take
their choices from here too. Plain data, no imports beyond the standard library: the config validates these
keys without importing torch or the loaders. Tests: ``tests/test_choices.py``.
"""

import math
from typing import Any

NAV_SCOPES: tuple[str, ...] = ("none", "trigger", "suffix", "suffix_nontrigger", "sequence")
"""Scopes of the negative-advantage veto (``algo.nav_scope``); see `mugrpo_async.algo.nav_mask`."""

LOSS_AGGS: tuple[str, ...] = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
"""Loss aggregations (``algo.loss_agg``); see `mugrpo_async.algo.aggregate`."""

DATA_FORMATS: tuple[str, ...] = ("math", "gsm8k", "aime", "amc", "custom")
"""Row formats of data files (``data.format``, besides ``auto``); see `mugrpo_async.data.loaders.FORMATS`."""

PROMPT_TEMPLATES: tuple[str, ...] = ("auto", "chat", "plain", "none")
"""Prompt forms (``data.template``); see `mugrpo_async.data.prompts`."""

BENCHMARK_NAMES: tuple[str, ...] = ("heldout", "math500", "aime24", "aime25", "amc23", "gsm8k", "humaneval")
"""Evaluation benchmarks (``eval.benchmarks``); see `mugrpo_async.evaluation.benchmarks.BENCHMARKS`."""

MODEL_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
"""Weight dtypes (``model.dtype``); see `mugrpo_async.reporting.plan.DTYPE_BYTES`."""

SCHEDULE_MODES: tuple[str, ...] = ("sync", "async")
"""Run modes (``schedule.mode``, ``launch.train --mode``)."""

OVERLONG_MODES: tuple[str, ...] = ("none", "mask", "soft_penalty")
"""Handling of responses cut at the length limit (``algo.overlong``): kept, masked out of the loss, or DAPO's
soft penalty on the reward; see `mugrpo_async.algo.overlong_penalty`."""

LR_SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")
"""Learning-rate schedules after the warmup (``trainer.lr_schedule``); see `mugrpo_async.training.lr_schedule`."""

PLACEMENT_MODES: tuple[str, ...] = ("split", "colocated")
"""Device layouts (``placement.mode``); see `mugrpo_async.placement`."""

ALGO_PRESETS: dict[str, dict[str, Any]] = {
    # mu-GRPO: relaxed ratio bounds [0, 5] + negative-advantage veto over the whole sequence.
    "mu_grpo": dict(clip_low=0.0, clip_high=5.0, nav_scope="sequence", nav_tau=1e-4, m2po_threshold=None),
    # Standard GRPO / PPO clipping with ratio bounds [0.8, 1.2], no veto.
    "grpo": dict(clip_low=0.8, clip_high=1.2, nav_scope="none", nav_tau=1e-4, m2po_threshold=None),
    # Relaxed bounds without the veto (the paper's collapsing ablation).
    "grpo_relaxed": dict(clip_low=0.0, clip_high=5.0, nav_scope="none", nav_tau=1e-4, m2po_threshold=None),
    # M2PO: second-moment trust region (mask largest squared log ratios until mean <= 0.04).
    "m2po": dict(clip_low=0.0, clip_high=math.inf, nav_scope="none", nav_tau=1e-4, m2po_threshold=0.04),
}
"""Named algorithm presets (the paper's method and its baselines): ``algo.name`` picks one; any field given
explicitly in the config overrides the preset's value."""
