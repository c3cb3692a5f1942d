"""The staleness study: variant registry, run status, aggregation and tables on stored fixtures, the
figures, and (slow) two variants x one seed through the real CLI.

The fixtures (``tests/fixtures/study/<variant>/seed-<s>/``) are 8-update runs (mu = 4, two stages)
with hand-set numbers: mu_grpo evaluates 0.30 + 0.02 s then 0.40 + 0.02 s, relaxed 0.35 + 0.02 s then
0.10 + 0.02 s (its seed 1 resumed at update 4, a first write of update 5 with clip_frac 999 superseded),
grpo has no eval records (the training-reward fallback: stage rewards 0.2, 0.3).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from mugrpo_async.config import load_config, save_config
from mugrpo_async.reporting import study, study_tables
from tests.conftest import REPO

FIXTURES = REPO / "tests" / "fixtures" / "study"


def _runs(variant: str, seeds=(0, 1)) -> list[study.RunData]:
    return [study.load_run(FIXTURES / variant / f"seed-{s}", variant, s) for s in seeds]


def _rows() -> dict[str, dict]:
    runs = _runs("mu_grpo") + _runs("relaxed") + _runs("grpo", (0,))
    return {r["variant"]: r for r in study.aggregate_variants([study.summarize_run(d) for d in runs])}


def test_variants_cover_the_paper_comparisons_and_only_touch_algo_and_mu():
    core = study.resolve_variants(["core"])
    assert [v.name for v in core][:2] == ["grpo_mu4", "grpo"] and len(core) == 8
    for v in study.VARIANTS.values():
        assert all(o.split("=")[0].startswith(("algo.", "schedule.mu")) for o in v.overrides), v.name
    scopes = {load_config(REPO / "configs/study/tiny.yaml", list(study.VARIANTS[n].overrides)).algo.nav_scope
              for n in study.SCOPE_VARIANTS}  # fmt: skip
    assert scopes == {"none", "trigger", "suffix", "suffix_nontrigger", "sequence"}
    sweep = study.resolve_variants(["mu", "mu_grpo"])  # a group and a member of it: each variant once
    assert len(sweep) == len(study.MU_SWEEP) + 1
    with pytest.raises(KeyError, match="valid: .*groups: core"):
        study.resolve_variants(["mu_grpoo"])


def test_run_status_new_partial_done_and_mismatch(tmp_path):
    cfg = load_config(REPO / "configs/study/tiny.yaml", [f"run.output_dir={tmp_path}"])
    assert study.run_status(tmp_path, cfg) == "new"
    save_config(cfg, tmp_path / "config.yaml")
    (tmp_path / "metrics.jsonl").write_text('{"kind": "update", "update": 1}\n{"kind": "upd')  # torn last line
    assert study.run_status(tmp_path, cfg) == "partial"
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('\n{"kind": "end", "updates": 128}\n')
    assert study.run_status(tmp_path, cfg) == "done"
    longer = load_config(REPO / "configs/study/tiny.yaml", ["schedule.total_updates=256"])
    assert study.run_status(tmp_path, longer) == "partial"  # a finished run can be extended
    other = load_config(REPO / "configs/study/tiny.yaml", ["trainer.lr=1e-5"])
    assert study.run_status(tmp_path, other) == "mismatch"


def test_run_summary_reads_evals_stages_and_the_newest_record():
    (run,) = _runs("relaxed", (1,))
    assert [r["update"] for r in run.updates] == list(range(1, 9)) and run.updates[4]["clip_frac"] == 0.05
    s = study.summarize_run(run)
    assert s["acc_source"] == "eval" and s["best_acc"] == pytest.approx(0.37) and s["final_acc"] == pytest.approx(0.12)
    assert s["clip_frac"] == pytest.approx(0.045) and s["veto_per_stage"] == [0.0, 0.0]
    assert (s["mu"], s["clip"], s["scope"], s["T_total"]) == (4, (0.0, 5.0), "none", 62.0)
    (grpo,) = _runs("grpo", (0,))
    source, pts = study.accuracy_points(grpo)
    assert source == "train_reward" and pts == [(0, 11.0, 0.2), (4, 15.0, 0.3)]  # first update of each stage


def test_initial_accuracy_leads_the_curves_but_not_best_or_final():
    acc = study.initial_accuracy(FIXTURES / "initial" / "seed-0.json")
    assert acc == 0.2 and study.initial_accuracy(FIXTURES / "initial" / "seed-9.json") is None
    run = study.load_run(FIXTURES / "relaxed" / "seed-0", "relaxed", 0, initial=0.5)
    assert study.accuracy_points(run, with_initial=True)[1][0] == (0, 0.0, 0.5)
    assert study.summarize_run(run)["best_acc"] == pytest.approx(0.35)  # the untrained policy is not a result
    text = study_tables.study_report(study.aggregate_variants([study.summarize_run(run)]), [0.2, 0.3])
    assert text.startswith("Held-out accuracy before training: 0.250 ± 0.071 (2 seeds)")


def test_aggregate_gives_mean_and_sample_std_over_seeds():
    rows = _rows()
    mu = rows["mu_grpo"]
    assert mu["seeds"] == [0, 1] and mu["acc_source"] == "eval"
    for key, mean in (("best_acc", 0.41), ("final_acc", 0.41), ("T_rollout", 20.5), ("T_total", 61.0)):
        assert mu[key][0] == pytest.approx(mean) and mu[key][2] == 2, key
    assert mu["best_acc"][1] == pytest.approx(math.sqrt(2) * 0.01)  # ddof=1 over 0.40, 0.42
    assert mu["T_total"][1] == pytest.approx(math.sqrt(2))
    assert mu["veto_per_stage"] == pytest.approx([0.1, 0.0]) and mu["veto_frac"][0] == pytest.approx(0.05)
    relaxed = rows["relaxed"]
    assert relaxed["best_acc"][0] == pytest.approx(0.36) and relaxed["final_acc"][0] == pytest.approx(0.11)
    assert rows["grpo"]["acc_source"] == "train_reward" and rows["grpo"]["best_acc"] == (0.3, 0.0, 1)
    assert study.mean_std([1.0, math.nan, None])[1:] == (0.0, 1) and study.mean_std([])[2] == 0


def test_tables_show_every_variant_and_flag_the_fallback():
    rows = _rows()
    text = study_tables.study_report(list(rows.values()))
    assert "| mu-GRPO ([0,5] veto S_seq) | [0, 5] | sequence | 4 | 0.410 ± 0.014 | 0.410 ± 0.014 |" in text
    assert "0.100 / 0.000" in text and "best acc*" in text and "training reward" in text
    held = study_tables.variant_table([rows["mu_grpo"], rows["relaxed"]])
    assert "best held-out acc" in held and held.count("\n") == 3  # header, rule, two rows
    sweep = study_tables.sweep_table([rows["mu_grpo"], rows["relaxed"]], "mu")
    assert sweep.splitlines()[0].startswith("| mu | stages |")
    assert study_tables._stages([0.1] * 32).startswith("quarters ")


def test_seed_curve_aligns_seeds_and_ignores_missing_values():
    series = [study.update_series(r, "ratio_mean_neg_adv", zero_is_missing=True) for r in _runs("mu_grpo")]
    c = study.seed_curve(series)
    assert list(c["x"]) == list(range(1, 9)) and c["t"][0] == pytest.approx(11.0)
    assert math.isnan(c["y"][2])  # update 3 has no negative-advantage tokens in either seed
    assert c["y"][1] == pytest.approx(1.0 - 0.1 - 0.025) and c["y_std"][1] == pytest.approx(0.05 / math.sqrt(2))
    one = study.seed_curve([[(1, 0.0, 1.0), (2, 1.0, 3.0)], [(2, 2.0, 5.0)]])
    assert list(one["x"]) == [2.0] and one["y"][0] == 4.0 and one["t"][0] == 1.5
    sm = study.running_mean(np.array([1.0, np.nan, 3.0, 5.0]), 3)
    assert sm == pytest.approx([1.0, 2.0, 4.0, 4.0])


def test_figures_are_written_small(tmp_path):
    from launch.study_plot import plot_study

    runs = {"mu_grpo": _runs("mu_grpo"), "relaxed": _runs("relaxed"), "grpo": _runs("grpo", (0,))}
    paths = plot_study(runs, tmp_path)
    names = {p.name for p in paths}
    assert names == {"accuracy_vs_time.png", "accuracy_clip_over_updates.png", "accuracy_by_scope.png",
                     "ratio_neg_adv_by_scope.png", "veto_frac_over_updates.png", "accuracy_per_seed.png"}  # fmt: skip
    runs["mu_grpo_mu128"] = _runs("relaxed")  # stands in for a second mu of the sweep
    assert (tmp_path / "mu_sweep.png") in plot_study(runs, tmp_path)
    for r in runs["relaxed"]:  # records with the ratio tail and histogram get the figures of both
        for u in r.updates:
            u |= {"ratio_below_0p1_neg_adv_frac": 0.01, "hist_log_ratio_neg_adv": {"0": 1.0, "161": 9.0}}
    more = {p.name for p in plot_study(runs, tmp_path)} - names
    assert more == {"mu_sweep.png", "ratio_tail_by_scope.png", "ratio_hist_by_scope.png"}
    assert all(p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size < 150_000 for p in paths)


def test_cli_rejects_bad_variants_and_lists_the_plan(tmp_path):
    cmd = [sys.executable, "-m", "launch.study", "--config", "configs/study/tiny.yaml", "--out", str(tmp_path)]
    bad = subprocess.run([*cmd, "--variants", "core,nope"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown variant 'nope'" in bad.stderr and "Traceback" not in bad.stderr
    odd = subprocess.run([*cmd, "--variants", "mu_grpo_mu64", "schedule.total_updates=96"], cwd=REPO,
                         capture_output=True, text=True)  # fmt: skip
    assert odd.returncode == 2 and "variant mu_grpo_mu64" in odd.stderr and "multiple of schedule.mu" in odd.stderr
    dry = subprocess.run([*cmd, "--variants", "grpo,mu_grpo", "--seeds", "0,1", "--dry-run"], cwd=REPO,
                         capture_output=True, text=True)  # fmt: skip
    assert dry.returncode == 0 and dry.stdout.count("new") == 4 and not any(tmp_path.iterdir())
    lines = [line.split()[-1] for line in dry.stdout.splitlines()]
    assert lines == [str(tmp_path / v / f"seed-{s}") for s in (0, 1) for v in ("grpo", "mu_grpo")]  # seed-major


@pytest.mark.slow
def test_two_variants_one_seed_through_the_cli(tiny_model, tmp_path):
    """The real study loop on one fixed rollout set (``--replay-from``): two short runs with evaluations, the
    second trained on the first one's stored stage, then a rerun that skips both and only reports."""
    cmd = [sys.executable, "-m", "launch.study", "--config", "configs/study/tiny.yaml", "--variants",
           "mu_grpo,grpo", "--replay-from", "grpo", "--seeds", "0", "--out", str(tmp_path),
           f"model.path={tiny_model}", "schedule.total_updates=4", "schedule.mu=4", "schedule.groups_per_update=4",
           "rollout.seeded_sampling=true", "eval.every_updates=2", "eval.num_problems=16",
           "--skip-initial"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    runs = {v: study.load_run(tmp_path / v / "seed-0", v, 0) for v in ("grpo", "mu_grpo")}
    for run in runs.values():  # one stage of 4 updates, evaluated mid-stage and at the end
        assert [e["update"] for e in run.evals] == [2, 4] and run.end["updates"] == 4
        assert [r["update"] for r in run.updates] == [1, 2, 3, 4]
        last = run.evals[-1]
        assert 0 <= last["eval/heldout/level_1"] <= 1 and 0 <= last["eval/heldout/format_rate"] <= 1
    (generated,), (replayed,) = runs["grpo"].stages, runs["mu_grpo"].stages  # grpo ran first and generated it
    assert generated["t_rollout_s"] > 0 and replayed["t_rollout_s"] == 0
    for key in ("reward_mean", "response_tokens"):  # the same groups
        assert replayed[key] == generated[key], key
    report = (tmp_path / "study.md").read_text()
    assert "| mu-GRPO ([0,5] veto S_seq) |" in report and not (tmp_path / "initial").exists()
    assert "## Claims" in report and "## Held-out accuracy by level" in report
    assert "Stage check: 1 finished runs compared" in report and "left out" not in report  # the replay's own stage
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {"accuracy_vs_time.png", "veto_frac_over_updates.png"}
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 0 and again.stdout.count("    done  ") == 2 and "run 1/2" not in again.stderr


def test_the_veto_per_stage_weighted_by_tokens_and_nan_without_the_counts():
    ups = [{"policy_version": 0, "num_vetoed": 10.0, "num_tokens": 100.0, "nav_veto_frac": 0.1},
           {"policy_version": 0, "num_vetoed": 0.0, "num_tokens": 900.0, "nav_veto_frac": 0.0},
           {"policy_version": 1, "nav_veto_frac": 0.5}]  # fmt: skip
    run = study.RunData("mu_grpo", 0, {}, ups, [], [], None)
    assert study.per_stage(run, "nav_veto_frac") == [0.05, 0.5]  # the mean over updates weighs them alike
    weighted = study.per_stage_tokens(run)
    assert weighted[0] == pytest.approx(0.01) and math.isnan(weighted[1])


def test_compute_line_sums_every_run_wall_time():
    rows = [{"seeds": [0, 1], "T_total": (1800.0, 10.0, 2)}, {"seeds": [0], "T_total": (3600.0, math.nan, 1)},
            {"seeds": [3], "T_total": (math.nan, math.nan, 0)}]  # fmt: skip
    assert study_tables.compute_line(rows).startswith("Compute: 4 finished runs, 2.00 machine-hours")


def test_ratio_histogram_pools_bins_over_runs_and_updates():
    runs = _runs("relaxed")
    for r in runs:
        for u in r.updates:
            u["hist_log_ratio_neg_adv"] = {"0": 1.0, "161": 3.0} if u["update"] <= 2 else {"201": 4.0}
    x, share = study.ratio_histogram(runs, 1, 2)  # 2 runs x 2 updates: 4 tokens below 1e-8, 12 at rho ~ 1
    assert x == pytest.approx([-8.025, 0.025]) and share == pytest.approx([0.25, 0.75])
    x, share = study.ratio_histogram(runs, 3, 3)
    assert x == pytest.approx([2.025]) and share == pytest.approx([1.0])  # bin 201: rho >= 100
    assert study.ratio_histogram(_runs("grpo", (0,)), 1, 8)[0].size == 0  # records without a histogram


def test_the_study_reports_import_without_torch_or_ray():
    import subprocess

    code = ("import sys, mugrpo_async.reporting.study, mugrpo_async.reporting.claims; "
            "assert 'torch' not in sys.modules and 'ray' not in sys.modules")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
