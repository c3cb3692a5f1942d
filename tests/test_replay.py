"""Replaying an earlier run's stages (``rollout.replay_dir``): which configs may, checked before anything starts.
The replay through the CLI runs in ``tests/test_dynamic_sampling.py`` (a refilled stage replayed by GRPO)."""

from __future__ import annotations

import pytest

from mugrpo_async.config import ConfigError, load_config, save_config
from mugrpo_async.rollout.replay import replay_problems


@pytest.fixture
def earlier(tmp_path):
    shape = ["schedule.mu=8", "schedule.groups_per_update=4", "schedule.total_updates=16"]
    cfg = load_config("configs/tiny-cpu.yaml", [f"run.output_dir={tmp_path / 'a'}", *shape])
    (tmp_path / "a").mkdir()
    save_config(cfg, tmp_path / "a" / "config.yaml", ["an earlier run"])
    return tmp_path / "a"


def _replaying(earlier, *overrides):
    return load_config("configs/tiny-cpu.yaml", ["schedule.mu=8", "schedule.groups_per_update=4",
                                                 "schedule.total_updates=16", f"rollout.replay_dir={earlier}",
                                                 *overrides])  # fmt: skip


def test_another_algorithm_lr_or_batch_shape_may_replay(earlier):
    assert replay_problems(_replaying(earlier, "algo.name=grpo", "trainer.lr=3e-4")) == []
    same_stage = _replaying(earlier, "schedule.mu=4", "schedule.groups_per_update=8")  # 32 groups a stage either way
    assert replay_problems(same_stage) == []


def test_what_changes_the_samples_is_refused_by_name(earlier, tmp_path):
    problems = replay_problems(_replaying(earlier, "rollout.temperature=0.5", "schedule.groups_per_update=8"))
    assert len(problems) == 2
    assert "rollout.temperature=1.0" in problems[0] and "schedule.groups_per_stage=32" in problems[1]
    assert "not a run folder" in replay_problems(_replaying(tmp_path / "nothing"))[0]
    with pytest.raises(ConfigError, match="rollout.replay_dir"):
        _replaying(earlier, "schedule.mode=async")
