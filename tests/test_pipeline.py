"""Integration: whole staged runs through the real CLI (Ray + vLLM + DeepSpeed), every preset."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mugrpo_async.reporting.metrics import read_metrics
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


def test_two_stage_run_writes_the_run_folder(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from mugrpo_async.rollout.shards import read_stage

    out = tmp_path / "run"
    proc = run_cli(tiny_model, out, "schedule.total_updates=4", "schedule.mu=2", "eval.benchmarks=[heldout]",
                   "eval.every_updates=3", "eval.num_problems=16")  # fmt: skip
    assert "reward per stage:" in proc.stdout and "T_total" in proc.stdout
    assert (out / "config.yaml").is_file()
    updates = read_metrics(out, "update")
    assert [r["update"] for r in updates] == [1, 2, 3, 4]
    assert all(UPDATE_KEYS <= set(r) for r in updates)
    assert [r["policy_version"] for r in updates] == [0, 0, 2, 2]
    assert [r["lag_max"] for r in updates] == [0, 1, 0, 1]
    stages = read_metrics(out, "stage")
    assert [s["stage"] for s in stages] == [0, 1] and all("t_rollout_s" in s and "reward_mean" in s for s in stages)
    (end,) = read_metrics(out, "end")
    assert end["T_total"] >= end["T_rollout"] > 0 and len(end["reward_per_stage"]) == 2
    for k in (0, 1):
        manifest, groups = read_stage(out / "rollouts" / f"stage-{k}")
        assert manifest["complete"] and len(groups) == 8 and {g.policy_version for g in groups} == {2 * k}
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "final")
    evals = read_metrics(out, "eval")  # mid-stage at update 3, and the end of the run
    assert [e["update"] for e in evals] == [3, 4] and all(e["eval/mean"] == e["eval/heldout"] for e in evals)
    best = max(evals, key=lambda e: e["eval/mean"])
    assert best["best"] and AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "best") is not None
    summary = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"kind": "end"')]
    assert summary and summary[0]["T_total"] == end["T_total"]


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
    assert len(updates) == 2 and all(r["loss"] == r["loss"] for r in updates)  # finite, not NaN
    if preset == "m2po":
        assert all("m2po_mask_frac" in r for r in updates)
    if preset == "grpo":
        assert all(r["nav_veto_frac"] == 0.0 for r in updates)
