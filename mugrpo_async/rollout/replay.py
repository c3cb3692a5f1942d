"""Training on the stages an earlier run generated: the same prompts, samples, rewards and advantages, trained by
another algorithm, learning rate or batch size (``rollout.replay_dir``: a fixed rollout set, as a staleness study
needs). Pure: no Ray.

A replayed stage is read, never written: its folder (``<replay_dir>/rollouts/stage-K/``, and its refill rounds
under dynamic sampling) must be complete, every shard's sha256 good. The two runs must agree on everything that
decides a stage's groups (:data:`GENERATION_KEYS`, compared with the earlier run's ``config.yaml`` before anything
starts): the model, the data, the sampling, the reward, the advantage rule, the seed, and the stage's size
``mu x B_mini`` (so B_mini and mu may change together: one epoch over 16,384 groups is mu = 1024 at B_mini = 16
and mu = 256 at B_mini = 64).
"""

from __future__ import annotations

from pathlib import Path

from mugrpo_async.config import Config, load_config

GENERATION_KEYS = (
    "model.path", "model.dtype", "data", "rollout.group_size", "rollout.temperature", "rollout.max_new_tokens",
    "rollout.seeded_sampling", "rollout.dynamic_sampling", "rollout.max_refill_rounds", "reward.function",
    "reward.options", "algo.advantage_std_norm", "algo.overlong", "algo.overlong_buffer", "run.seed",
    "schedule.groups_per_stage",
)  # fmt: skip
"""What decides a stage's groups (``schedule.groups_per_stage`` = mu x B_mini)."""


def _value(cfg: Config, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node.model_dump(mode="json") if hasattr(node, "model_dump") else node


def replay_problems(cfg: Config) -> list[str]:
    """Why ``cfg`` cannot train on ``rollout.replay_dir``'s stages (empty: it can; also when no replay is set)."""
    folder = cfg.rollout.replay_dir
    if not folder:
        return []
    path = Path(folder) / "config.yaml"
    if not path.is_file():
        return [f"rollout.replay_dir: {folder} holds no config.yaml (not a run folder)"]
    try:
        other = load_config(path)
    except (ValueError, OSError) as err:
        return [f"rollout.replay_dir: {path} does not load ({err})"]
    return [f"rollout.replay_dir: {folder} generated its stages with {key}={_value(other, key)!r}, this run has "
            f"{_value(cfg, key)!r}" for key in GENERATION_KEYS if _value(other, key) != _value(cfg, key)]  # fmt: skip


def replayed_dir(cfg: Config, run_dir: Path, stage_dir: Path) -> Path:
    """The earlier run's folder that stands for this run's ``stage_dir`` (a stage or one of its refill rounds)."""
    return Path(cfg.rollout.replay_dir).resolve() / stage_dir.relative_to(run_dir)
