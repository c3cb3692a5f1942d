"""Integration: whole staged runs through the real CLI (Ray + vLLM + DeepSpeed), every preset."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from mugrpo_async.reporting.metrics import read_metrics
from mugrpo_async.rollout.shards import read_stage
from tests.conftest import REPO

pytestmark = pytest.mark.slow

UPDATE_KEYS = {
    "update", "policy_version", "loss", "grad_norm", "clip_frac", "nav_veto_frac", "ratio_mean_neg_adv", "lag_mean",
    "lag_max", "reward_mean", "response_len_mean", "t_wait_s", "t_step_s", "trainer_idle_ratio",
}  # fmt: skip


def run_cli(model, out, *overrides, timeout=600):
    cmd = [
        sys.executable, "-m", "launch.train", "--config", "configs/tiny-cpu.yaml", f"model.path={model}",
        f"run.output_dir={out}", "run.dashboard=false", "logging.progress=false", "schedule.groups_per_update=4",
        *overrides,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def check_idle_ratio(updates: list[dict]) -> None:
    """Every update's trainer_idle_ratio is the cumulative wait over the cumulative wait + step time (one rank)."""
    wait = busy = 0.0
    for r in updates:
        assert r["t_wait_s"] > 0 and r["t_step_s"] > 0
        wait, busy = wait + r["t_wait_s"], busy + r["t_step_s"]
        assert r["trainer_idle_ratio"] == pytest.approx(wait / (wait + busy), rel=1e-9), r["update"]


def check_stages_against_shards(out, mu: int) -> None:
    """Stage and update records recomputed from the stored stage datasets (sync mode, one trainer rank)."""
    updates, stages = read_metrics(out, "update"), read_metrics(out, "stage")
    assert len(updates) == mu * len(stages)
    check_idle_ratio(updates)
    for s in stages:
        manifest, groups = read_stage(out / "rollouts" / f"stage-{s['stage']}")
        rewards = [x for g in groups for x in g.rewards]
        lengths = [len(resp) for g in groups for resp in g.responses]
        assert s["groups"] == manifest["totals"]["groups"] == len(groups)
        assert s["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
        assert s["response_tokens"] == manifest["totals"]["response_tokens"] == sum(lengths)
        mine = updates[s["stage"] * mu : (s["stage"] + 1) * mu]
        # one behaviour policy per stage: update u of the stage trains at lag u
        assert [(r["policy_version"], r["lag_mean"], r["lag_max"]) for r in mine] == [
            (s["stage"] * mu, u, u) for u in range(mu)
        ]
        # the stage's mu minibatches are a permutation of all its groups, of equal size
        assert sum(r["reward_mean"] for r in mine) / mu == pytest.approx(s["reward_mean"])
        assert sum(r["response_len_mean"] for r in mine) / mu == pytest.approx(sum(lengths) / len(lengths))
        # lag 0: the trainer holds the behaviour policy, so every ratio is 1 up to the engine/trainer gap,
        # nothing is clipped or vetoed, and sum_i A_i = 0 per group leaves |L| <= max|A| * max|rho - 1|
        first = mine[0]
        gap = max(first["ratio_max"] - 1.0, 1.0 - first["ratio_min"])
        assert 0.0 <= gap < 1e-3 and first["clip_frac"] == 0.0 and first["nav_veto_frac"] == 0.0
        assert abs(first["loss"]) <= max(abs(a) for g in groups for a in g.advantages) * gap + 1e-7


def test_two_stage_run_writes_the_run_folder(tiny_model, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    proc = run_cli(tiny_model, out, "schedule.total_updates=4", "schedule.mu=2", "eval.benchmarks=[heldout]",
                   "eval.every_updates=3", "eval.num_problems=16")  # fmt: skip
    assert (out / "config.yaml").is_file()
    updates = read_metrics(out, "update")
    assert [r["update"] for r in updates] == [1, 2, 3, 4]
    assert all(UPDATE_KEYS <= set(r) for r in updates)
    assert [r["policy_version"] for r in updates] == [0, 0, 2, 2]
    assert [r["lag_max"] for r in updates] == [0, 1, 0, 1]
    stages = read_metrics(out, "stage")
    assert [s["stage"] for s in stages] == [0, 1] and all(s["t_rollout_s"] > 0 for s in stages)
    assert all(0 < s["engine_occupancy"] <= 1 for s in stages)  # running sequences over max_num_seqs
    check_stages_against_shards(out, mu=2)
    (end,) = read_metrics(out, "end")
    assert end["T_rollout"] == pytest.approx(sum(s["t_rollout_s"] for s in stages))
    assert end["T_total"] > end["T_rollout"] > 0 and end["reward_per_stage"] == [s["reward_mean"] for s in stages]
    assert "reward per stage: " + " -> ".join(f"{r:.3f}" for r in end["reward_per_stage"]) in proc.stdout
    assert f"T_rollout {end['T_rollout']:.1f}s" in proc.stdout and f"T_total {end['T_total']:.1f}s" in proc.stdout
    for k in (0, 1):
        manifest, groups = read_stage(out / "rollouts" / f"stage-{k}")
        assert manifest["complete"] and len(groups) == 8 and {g.policy_version for g in groups} == {2 * k}
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "final")
    evals = read_metrics(out, "eval")  # mid-stage at update 3, and the end of the run
    assert [e["update"] for e in evals] == [3, 4] and all(e["eval/mean"] == e["eval/heldout"] for e in evals)
    for e in evals:
        heldout = e["benchmarks"]["heldout"]
        assert heldout["problems"] + heldout["dropped"] == 16 and heldout["pass@1"] == e["eval/heldout"]
        assert heldout["pass@k"]["1"] == heldout["pass@1"] <= heldout["pass@k"]["4"]
    # the first evaluation is the best so far; a later one only when strictly better
    assert [e["best"] for e in evals] == [True, evals[1]["eval/mean"] > evals[0]["eval/mean"]]
    best_update = 4 if evals[1]["best"] else 3
    best, final = (load_file(str(out / "checkpoints" / d / "model.safetensors")) for d in ("best", "final"))
    assert best.keys() == final.keys()
    assert all(torch.equal(best[k], final[k]) for k in best) == (best_update == 4)  # update 4 moved the weights
    summary = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"kind": "end"')]
    assert len(summary) == 1 and summary[0] == end


def test_actors_that_do_not_fit_fail_fast_naming_the_keys(tiny_model, tmp_path):
    cmd = [sys.executable, "-m", "launch.train", "--config", "configs/tiny-cpu.yaml", f"model.path={tiny_model}",
           f"run.output_dir={tmp_path}", "run.dashboard=false", "rollout.num_workers=64"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "rollout.num_workers" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("preset", ["grpo", "grpo_relaxed", "m2po"])
def test_every_preset_trains_through_the_cli(tiny_model, tmp_path, preset):
    out = tmp_path / preset
    run_cli(tiny_model, out, f"algo.name={preset}", "schedule.total_updates=2", "schedule.mu=2")
    updates = read_metrics(out, "update")
    assert len(updates) == 2 and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in updates)
    check_stages_against_shards(out, mu=2)  # among them: the lag-0 loss is 0 up to the engine/trainer gap
    if preset == "m2po":  # lag 0: the mean squared log ratio is far below 0.04, nothing is masked
        assert updates[0]["m2po_mask_frac"] == 0.0 and 0.0 <= updates[1]["m2po_mask_frac"] <= 1.0
    else:
        assert all(r.get("m2po_mask_frac", 0.0) == 0.0 for r in updates)
    if preset in ("grpo", "grpo_relaxed"):  # no veto in these presets, whatever the ratios
        assert all(r["nav_veto_frac"] == 0.0 for r in updates)
