"""The study's run plan with a fixed rollout set per seed (``launch.study --replay-from``): which runs, their
overrides, their order and status, planned without starting anything."""

from __future__ import annotations

import json

import pytest

from mugrpo_async.config import ConfigError, load_config, save_config
from mugrpo_async.reporting import study_plan as sp
from mugrpo_async.reporting.study import resolve_variants, run_status
from tests.conftest import REPO

CONFIG = REPO / "configs" / "study" / "tiny.yaml"
SHAPE = ["rollout.seeded_sampling=true"]


def _plan(out, names=("relaxed", "mu_grpo", "grpo"), seeds=(0, 1), replay="grpo", overrides=SHAPE):
    return sp.study_plan(CONFIG, resolve_variants(list(names)), list(seeds), out, list(overrides), replay)


def _write_run(run: sp.PlannedRun, *, finished: bool) -> None:
    """A run folder as ``launch.train`` leaves it: the resolved config and, when finished, an ``end`` record."""
    cfg = load_config(CONFIG, run.overrides)
    run.path.mkdir(parents=True)
    save_config(cfg, run.path / "config.yaml")
    rows = [{"kind": "update", "update": 1}]
    rows += [{"kind": "end", "updates": cfg.schedule.total_updates}] if finished else []
    (run.path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_source_runs_first_in_each_seed_and_the_others_replay_it(tmp_path):
    runs = _plan(tmp_path)
    assert [(r.variant, r.seed) for r in runs] == [(v, s) for s in (0, 1) for v in ("grpo", "relaxed", "mu_grpo")]
    for r in runs:
        source = tmp_path / "grpo" / f"seed-{r.seed}"
        assert r.path == tmp_path / r.variant / f"seed-{r.seed}" and r.status == "new"
        assert r.source == (r.variant == "grpo")
        assert r.replay == (None if r.source else source)
        replays = [o for o in r.overrides if o.startswith("rollout.replay_dir=")]
        assert replays == ([] if r.source else [f"rollout.replay_dir={source}"])
        assert f"run.seed={r.seed}" in r.overrides and r.overrides[0] == SHAPE[0]
    assert load_config(CONFIG, runs[1].overrides).algo.name == "grpo_relaxed"
    # the source need not be listed: it is added, first
    assert [r.variant for r in _plan(tmp_path, ("mu_grpo",), (3,))] == ["grpo", "mu_grpo"]


def test_without_replay_the_plan_is_unchanged(tmp_path):
    runs = _plan(tmp_path, replay=None)
    assert [r.variant for r in runs[:3]] == ["relaxed", "mu_grpo", "grpo"]
    assert all(r.replay is None and not r.source for r in runs)
    assert not any(o.startswith("rollout.replay_dir") for r in runs for o in r.overrides)


def test_every_seed_resumes_and_reports_under_one_plan(tmp_path):
    """Seed 0 finished, seed 1's replay half done: a rerun over both seeds reads each folder as its own, where
    one fixed replay_dir for every seed read the other seeds' folders as runs of another configuration."""
    first = _plan(tmp_path)
    for r in first[:3]:
        _write_run(r, finished=True)
    _write_run(first[3], finished=True)  # seed 1's source
    _write_run(first[4], finished=False)  # seed 1's relaxed, started
    again = _plan(tmp_path)
    assert [r.status for r in again] == ["done"] * 4 + ["partial", "new"]
    assert [r.overrides for r in again] == [r.overrides for r in first]
    one_dir = load_config(CONFIG, [*first[4].overrides, f"rollout.replay_dir={first[0].path}"])
    assert run_status(first[4].path, one_dir) == "mismatch"
    assert sp.replay_blocker(again[5]) is None and sp.run_finished(first[3].path)


def test_a_replay_waits_for_its_source_to_finish(tmp_path):
    runs = _plan(tmp_path, seeds=(0,))
    assert "has not finished" in sp.replay_blocker(runs[1]) and sp.replay_blocker(runs[0]) is None
    _write_run(runs[0], finished=False)
    assert "has not finished" in sp.replay_blocker(runs[1])
    (runs[0].path / "metrics.jsonl").write_text(json.dumps({"kind": "end", "updates": 128}) + "\n")
    assert sp.replay_blocker(runs[1]) is None


def test_another_studys_source_is_read_not_run(tmp_path):
    """The B_mini sweep: its folder replays phase 1's ``grpo`` stages; B_mini x mu stays 16 x 32 = 512 groups."""
    p1 = _plan(tmp_path / "p1", ("grpo",), (0,), replay=None)
    _write_run(p1[0], finished=True)
    sweep = ["rollout.seeded_sampling=true", "schedule.groups_per_update=64", "schedule.mu=8",
             "schedule.total_updates=32"]  # fmt: skip
    runs = _plan(tmp_path / "b64", ("mu_grpo", "grpo"), (0,), str(tmp_path / "p1" / "grpo"), sweep)
    assert [r.variant for r in runs] == ["mu_grpo", "grpo"] and not any(r.source for r in runs)
    assert all(r.replay == p1[0].path for r in runs) and sp.replay_blocker(runs[0]) is None
    with pytest.raises(ConfigError, match="variant mu_grpo cannot replay.*schedule.groups_per_stage"):
        _plan(tmp_path / "b64", ("mu_grpo",), (0,), str(tmp_path / "p1" / "grpo"), [*sweep[:2], "schedule.mu=4",
              "schedule.total_updates=32"])  # fmt: skip
    unborn = _plan(tmp_path / "b64", ("mu_grpo",), (1,), str(tmp_path / "p1" / "grpo"), sweep)  # no seed-1 there
    assert "has not finished" in sp.replay_blocker(unborn[0])


def test_a_variant_that_would_generate_other_stages_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="variant grpo_mu4 cannot replay.*groups_per_stage"):
        _plan(tmp_path, ("grpo", "grpo_mu4"))
    with pytest.raises(KeyError, match="not a variant name"):
        _plan(tmp_path, replay="grpoo")
