"""Integration: a short staged run on the multi-step task through the real CLI (Ray + vLLM + DeepSpeed)."""

from __future__ import annotations

import pytest

from mugrpo_async.reporting.metrics import read_metrics
from mugrpo_async.rewards.boxed_math import boxed_reward
from mugrpo_async.rollout.shards import read_stage
from tests.test_pipeline import run_cli

pytestmark = pytest.mark.slow


def test_multi_step_task_trains_through_the_cli(tiny_steps_model, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "run"
    run_cli(tiny_steps_model, out, "--config", "configs/tiny-cpu-reasoning.yaml", "schedule.total_updates=2",
            "schedule.mu=2")  # fmt: skip
    assert [r["update"] for r in read_metrics(out, "update")] == [1, 2]
    _, groups = read_stage(out / "rollouts" / "stage-0")
    assert len(groups) == 8 and {g.meta["level"] for g in groups} <= set(range(1, 9))
    tokenizer = AutoTokenizer.from_pretrained(tiny_steps_model)
    lengths, rewards = [], []
    for g in groups:
        for response, reward, reason in zip(g.responses, g.rewards, g.finish_reasons):
            text = tokenizer.decode(response, skip_special_tokens=True)
            assert reward == boxed_reward(text, g.answer)  # the boxed-math reward scored the worked steps
            assert reason != "length" or len(response) == 128  # rollout.max_new_tokens
            lengths.append(len(response))
            rewards.append(reward)
    # worked steps: responses from a one-step answer (about 20 tokens) to eight steps and more
    assert min(lengths) < 40 and max(lengths) > 80
    assert 0 < sum(rewards) < len(rewards)
