"""DAPO's dynamic sampling in sync mode: the refill rule on hand-computed cases (no Ray), and one staged run through
the real CLI (Ray, vLLM, DeepSpeed on the tiny model) whose stage is refilled."""

from __future__ import annotations

import pytest

from mugrpo_async.reporting.metrics import read_metrics
from mugrpo_async.rollout.dynamic_sampling import StageFilter, informative, refill_size
from mugrpo_async.rollout.samples import Group
from mugrpo_async.rollout.shards import read_stage


def _group(pid: str, rewards: list[float]) -> Group:
    n = len(rewards)
    return Group(pid, [1], "a", [[2]] * n, [[-0.1]] * n, rewards, [0.0] * n, 0, ["stop"] * n)


def test_refill_size_scales_by_the_informative_share():
    assert refill_size(8, 8, 8) == 0 and refill_size(8, 9, 12) == 0  # full
    assert refill_size(8, 0, 8) == 8  # nothing kept yet: a whole stage again
    assert refill_size(8, 2, 8) == 8  # 6 needed at a share of 1/4 = 24, capped at the stage
    assert refill_size(8, 6, 8) == 3  # 2 needed at a share of 3/4: ceil(2 * 8 / 6) = 3


def test_stage_filter_refills_until_full_then_stops():
    f = StageFilter(target=4)
    f.add([_group("a", [1, 0]), _group("b", [1, 1]), _group("c", [0, 0]), _group("d", [0, 1])])
    assert [g.prompt_id for g in f.kept] == ["a", "d"] and [g.prompt_id for g in f.filtered] == ["b", "c"]
    assert f.next_round(max_rounds=3) == 4  # 2 needed at a share of 1/2
    f.rounds += 1
    f.add([_group("e", [1, 0]), _group("f", [0, 0]), _group("g", [0, 1]), _group("h", [1, 0])])
    assert f.next_round(max_rounds=3) == 0
    groups, stats = f.stage()
    assert [g.prompt_id for g in groups] == ["a", "d", "e", "g"]
    assert stats == {"groups_generated": 8, "groups_filtered": 3, "refill_rounds": 1, "groups_short": 0}


def test_stage_filter_short_after_the_bound_fills_with_filtered_groups():
    f = StageFilter(target=3)
    f.add([_group("a", [1, 1]), _group("b", [0, 1]), _group("c", [0, 0])])
    assert f.next_round(max_rounds=0) == 0  # no refill allowed
    groups, stats = f.stage()
    assert [g.prompt_id for g in groups] == ["b", "a", "c"] and stats["groups_short"] == 2
    assert not informative(groups[1]) and informative(groups[0])


@pytest.mark.slow
def test_sync_stage_is_refilled_through_the_cli(tiny_model, tmp_path):
    """Two-token responses never hold a boxed answer: every reward is 0, every group is filtered, so the stage
    takes its one refill round (B_train more prompts), is still short, and is filled with filtered groups. The
    same run checks the warmup schedule's lr in the update records."""
    from tests.test_pipeline import run_cli

    out = tmp_path / "run"
    run_cli(tiny_model, out, "schedule.total_updates=2", "schedule.mu=2", "rollout.group_size=2",
            "rollout.max_new_tokens=2", "rollout.dynamic_sampling=true", "rollout.max_refill_rounds=1",
            "trainer.lr_warmup_updates=2", "trainer.lr_schedule=linear", "trainer.lr=1e-6",
            "logging.tensorboard=false")  # fmt: skip
    (stage,) = read_metrics(out, "stage")
    assert (stage["groups_generated"], stage["groups_filtered"], stage["refill_rounds"]) == (16, 16, 1)
    assert stage["groups_short"] == 8 and stage["groups"] == 8 and stage["reward_mean"] == 0.0
    manifest, refill = read_stage(out / "rollouts" / "stage-0" / "refill-1")
    _, first = read_stage(out / "rollouts" / "stage-0")
    assert manifest["complete"] and len(refill) == len(first) == 8
    assert stage["response_tokens"] == sum(len(r) for g in first + refill for r in g.responses)
    updates = read_metrics(out, "update")
    assert [u["lr"] for u in updates] == pytest.approx([0.5e-6, 1e-6])  # warmup (u + 1) / 2
    # The same stage, refill round included, replayed by another algorithm at another B_mini: read, not generated.
    again = tmp_path / "replay"
    run_cli(tiny_model, again, "schedule.total_updates=1", "schedule.mu=1", "schedule.groups_per_update=8",
            "rollout.group_size=2", "rollout.max_new_tokens=2", "rollout.dynamic_sampling=true",
            "rollout.max_refill_rounds=1", "algo.name=grpo", f"rollout.replay_dir={out}",
            "logging.tensorboard=false")  # fmt: skip
    (replayed,) = read_metrics(again, "stage")
    assert (replayed["shards_generated"], replayed["t_rollout_s"]) == (0, 0.0) and replayed["shards_reused"] >= 2
    assert {k: replayed[k] for k in ("groups", "reward_mean", "response_tokens", "groups_generated")} == {
        k: stage[k] for k in ("groups", "reward_mean", "response_tokens", "groups_generated")
    }
    assert not (again / "rollouts").exists()


@pytest.mark.slow
def test_async_queue_filters_until_the_bound_through_the_cli(tiny_model, tmp_path):
    """Async mode, two-token responses: every group has equal (0) rewards. The queue filters the first
    (1 + max_refill_rounds) x B_mini = 8 groups of each policy version and then serves them as they are
    (groups_short): the run completes within the lag cap and every group is counted."""
    from tests.test_pipeline import run_cli

    out = tmp_path / "run"
    run_cli(tiny_model, out, "--mode", "async", "schedule.total_updates=2", "schedule.mu=2", "schedule.sync_every=2",
            "rollout.group_size=2", "rollout.max_new_tokens=2", "rollout.batch_groups=4",
            "rollout.dynamic_sampling=true", "rollout.max_refill_rounds=1", "logging.tensorboard=false")  # fmt: skip
    _, stored = read_stage(out / "rollouts" / "async")
    assert stored and all(r == 0.0 for g in stored for r in g.rewards)
    per_version: dict[int, list[str]] = {}
    for g in stored:  # in the order they were put
        per_version.setdefault(g.policy_version, []).append(g.meta["uid"])
    updates, (end,) = read_metrics(out, "update"), read_metrics(out, "end")
    assert [r["update"] for r in updates] == [1, 2] and all(r["lag_max"] <= 2 for r in updates)
    assert updates[0]["groups_filtered"] == 8 and updates[0]["groups_short"] >= 4  # only version 0 exists yet
    assert end["groups_filtered"] == sum(min(len(u), 8) for u in per_version.values())
    assert end["groups_short"] == sum(max(len(u) - 8, 0) for u in per_version.values())
    counted = end["served"] + end["dropped"] + end["groups_filtered"] + end["left_in_queue"]
    assert end["generated"] == len(stored) == counted
    served = [uid for r in updates for uid in r["group_uids"]]
    assert end["served"] == len(set(served)) == 8 and not set(served) & set(per_version[0][:8])  # none filtered
