"""The study report's claims table (mugrpo_async.reporting.claims): per-seed figures from synthetic run folders,
the verdicts over seeds, and ``launch.study --report-only`` writing them for a replayed study."""

from __future__ import annotations

import json
import math

import pytest

from launch import study as cli
from mugrpo_async.config import load_config, save_config
from mugrpo_async.reporting import claims
from mugrpo_async.reporting.study import load_run
from mugrpo_async.reporting.verdicts import NOT_TESTABLE, REPRODUCED
from tests.conftest import REPO

CONFIG = REPO / "configs" / "study" / "tiny.yaml"
SHAPE = ["schedule.total_updates=1024", "schedule.mu=256", "schedule.groups_per_update=16"]
RISE_FALL = [0.1 + 0.02 * k for k in range(1, 9)] + [0.25 - 0.01 * k for k in range(8)]  # peak 0.26 at 512


def _write(folder, accs, overrides=(), clip=(0.01, 0.03, 0.05), veto=(0.1, 0.01)):
    """A finished run of 1024 updates (4 stages of 256) as ``launch.train`` leaves it: eval/mean every 64
    updates from ``accs``; clip_frac ``clip[0]`` over updates 1-64, ``clip[2]`` over 769-1024, ``clip[1]``
    between; nav_veto_frac ``veto[0]`` in stage 0 and ``veto[1]`` after."""
    cfg = load_config(CONFIG, [*SHAPE, *overrides])
    folder.mkdir(parents=True)
    save_config(cfg, folder / "config.yaml")
    rows = []
    for u in range(1, 1025):
        c = clip[0] if u <= 64 else clip[2] if u > 768 else clip[1]
        rows.append({"kind": "update", "update": u, "policy_version": (u - 1) // 256 * 256, "clip_frac": c,
                     "nav_veto_frac": veto[0] if u <= 256 else veto[1], "t_wall_s": float(u)})  # fmt: skip
        if u % 64 == 0 and accs:
            acc = accs[u // 64 - 1]
            rows.append({"kind": "eval", "update": u, "eval/mean": acc, "eval/heldout/level_1": acc,
                         "eval/heldout/format_rate": 1.0, "t_wall_s": u + 0.5})  # fmt: skip
    rows.append({"kind": "end", "updates": 1024, "T_total": 1100.0, "T_rollout": 100.0})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_seed_figures_of_one_run(tmp_path):
    run = load_run(_write(tmp_path / "r", RISE_FALL), "relaxed", 0, initial=0.07)
    f = claims.seed_figures(run)
    assert f["final_acc"] == pytest.approx(0.18) and f["peak_acc"] == pytest.approx(0.26)
    assert f["collapsed"] is True and f["stable"] is False  # 0.26 - 0.18 = 0.08 >= 0.05
    assert f["acc_256"] == pytest.approx(0.18)  # the 4th point, update 256
    assert f["clip_rise"] == pytest.approx(0.04) and f["veto_drop"] == pytest.approx(0.09)
    assert f["late_acc"] == pytest.approx(0.19)  # descriptive: the mean of 0.20, 0.19, 0.18
    assert claims.arm_names(run, "p2/") == ["p2/relaxed", "p2/relaxed@16"]
    run.config["schedule"]["groups_per_update"] = 64  # a sweep run is its B_mini's arm only, never the main arm
    assert claims.arm_names(run) == ["relaxed@64"]
    # the untrained point counts for the peak: a run that only falls from it collapsed
    high = claims.seed_figures(load_run(tmp_path / "r", "relaxed", 0, initial=0.40))
    assert high["peak_acc"] == 0.40 and high["collapsed"] is True
    steady = claims.seed_figures(load_run(_write(tmp_path / "s", [0.1 + 0.01 * k for k in range(16)]), "grpo", 0))
    assert steady["collapsed"] is False and steady["peak_acc"] == steady["final_acc"] == pytest.approx(0.25)
    blind = claims.seed_figures(load_run(_write(tmp_path / "n", []), "grpo", 0))  # no eval records
    assert math.isnan(blind["final_acc"]) and blind["collapsed"] is None and blind["clip_rise"] == pytest.approx(0.04)


def test_claims_table_from_five_seeds(tmp_path):
    entries = []
    for s in range(5):
        arms = {"grpo": [0.1 + 0.005 * k for k in range(16)], "relaxed": RISE_FALL,
                "mu_grpo": [0.1 + 0.01 * k + 0.002 * s for k in range(16)]}  # fmt: skip
        for name, accs in arms.items():
            run = load_run(_write(tmp_path / name / f"seed-{s}", accs, [f"run.seed={s}"]), name, s, initial=0.07)
            entries.append({"arms": claims.arm_names(run), "seed": s, "figures": claims.seed_figures(run)})
    text = claims.claims_report(entries)
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| C")}
    assert rows["C2a"].endswith("| 5 of 5 seeds | reproduced |")  # relaxed collapses in every seed
    assert rows["C5a"].endswith("| 5 of 5 seeds | reproduced |")  # mu-GRPO stable, relaxed collapsed
    # mu-GRPO ends at 0.25 + 0.002 s, relaxed at 0.18: +0.074 with a spread of 0.003 over the seeds
    assert "| `final_acc`: mu_grpo − relaxed > 0 | +0.074 [+0.070, +0.078], n = 5 | reproduced |" in rows["C5b"]
    assert rows["C1a"].endswith(f"| +0.040 [+0.040, +0.040], n = 5 | {REPRODUCED} |")
    assert "C6a" not in rows and "No figures here for: C3, C4a" in text  # no veto_trigger nor sweep runs
    # a second folder (the B_mini sweep's mu_grpo at B 64) joins by its arm names
    sweep = [{"arms": ["mu_grpo@64"], "seed": s, "figures": {"final_acc": 0.2 + 0.01 * s}} for s in range(3)]
    values = claims.claim_values([*entries, *sweep])
    assert sorted(values["final_acc"]["mu_grpo@16"]) == list(range(5)) and "mu_grpo@64" in values["final_acc"]
    assert "| C6a |" in claims.claims_report([*entries, *sweep])


@pytest.mark.parametrize("seeds, verdict", [(5, NOT_TESTABLE), (2, "not decided (waits for C2a)")])
def test_no_collapse_leaves_stability_untestable(tmp_path, seeds, verdict):
    """Relaxed bounds that never collapse refute C2a on 5 seeds, so C5a (stability under the veto) cannot be
    tested; on 2 seeds C2a is not decided yet and C5a waits for it."""
    entries = []
    for s in range(seeds):
        for name in ("relaxed", "mu_grpo"):
            run = load_run(_write(tmp_path / name / f"seed-{s}", [0.1 + 0.01 * k for k in range(16)]), name, s)
            entries.append({"arms": claims.arm_names(run), "seed": s, "figures": claims.seed_figures(run)})
    text = claims.claims_report(entries)
    c5a = next(line for line in text.splitlines() if line.startswith("| C5a |"))
    assert c5a.endswith(f"| {seeds} of {seeds} seeds | {verdict} |")


def test_report_only_over_every_seed_of_a_replayed_study(tmp_path, capsys):
    """The CLI's report: every seed's folders read as finished under --replay-from, and study.md ends with the
    claims table; summary.json holds each run's arms and figures for --claims-with."""
    args = ["--config", str(CONFIG), "--variants", "relaxed,mu_grpo", "--replay-from", "grpo", "--seeds", "0,1",
            "--out", str(tmp_path / "p1"), "--plots", str(tmp_path / "plots"), *SHAPE,
            "rollout.seeded_sampling=true"]  # fmt: skip
    plan = cli.plan(cli._parser().parse_intermixed_args(args))
    assert [r.variant for r in plan[:3]] == ["grpo", "relaxed", "mu_grpo"]
    for r in plan:
        _write(r.path, RISE_FALL if r.variant == "relaxed" else [0.1] * 16, r.overrides)
    assert cli.main([*args, "--report-only"]) == 0
    out = capsys.readouterr().out
    assert out.count("    done  ") == 6 and "(replays " in out
    text = (tmp_path / "p1" / "study.md").read_text()
    assert "## Claims" in text and "| C5b |" in text and "| C2a |" in text
    assert "| [0,5] no veto | 1.000 ± 0.000 | 0.180 ± 0.000 | 2 |" in text  # by level, at the last evaluation
    summary = json.loads((tmp_path / "p1" / "summary.json").read_text())
    assert {e["arms"][0] for e in summary} == {"grpo", "relaxed", "mu_grpo"}
    assert all(e["figures"]["collapsed"] == (e["variant"] == "relaxed") for e in summary)
    p2 = ["--arms-prefix", "p2/", "--claims-with", str(tmp_path / "p1")]
    assert cli.main([*args, "--report-only", "--out", str(tmp_path / "p2"), *p2]) == 0  # no runs there
    assert "| C5b |" in (tmp_path / "p2" / "study.md").read_text()
    assert cli.main([*args, "--report-only", "--arms-prefix", "1m/"]) == 0  # no claim names 1m/: per seed only
    text = (tmp_path / "p1" / "study.md").read_text()
    assert "## Claims" not in text and "| C5b |" in text and "no verdicts" in text
    assert cli.main([*args, "--report-only", "--claims-with", str(tmp_path / "nowhere")]) == 2
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text(json.dumps([{"variant": "grpo", "seed": 0}]))  # no figures
    assert cli.main([*args, "--report-only", "--claims-with", str(tmp_path / "old")]) == 2


def test_the_bmini_table_puts_the_sweeps_folders_side_by_side():
    def entry(arm: str, seed: int, acc: float, collapsed: bool = False) -> dict:
        variant, b = arm.split("@")
        return {"arms": [variant, arm], "seed": seed, "figures": {"final_acc": acc, "collapsed": collapsed}}

    one = [entry("mu_grpo@16", s, a) for s, a in ((0, 0.5), (1, 0.6))] + [entry("grpo@16", 0, 0.4, True)]
    assert claims.bmini_table(one) == ""  # one B_mini: no sweep to show
    sweep = [*one, entry("mu_grpo@64", 0, 0.45), entry("mu_grpo@64", 1, 0.55), entry("p2/mu_grpo@16", 0, 0.9)]
    table = claims.bmini_table(sweep)
    assert "| variant | B_mini = 16 | B_mini = 64 |" in table
    assert "| mu_grpo | 0.550 ± 0.071 (n = 2; 0 collapsed) | 0.500 ± 0.071 (n = 2; 0 collapsed) |" in table
    assert "| grpo | 0.400 ± 0.000 (n = 1; 1 collapsed) | - |" in table and "0.900" not in table  # phase 2 apart


def test_the_late_table_is_descriptive_and_counts_late_drops():
    def entry(arm, seed, final, late, peak, collapsed):
        figs = {"final_acc": final, "late_acc": late, "peak_acc": peak, "collapsed": collapsed}
        return {"arms": [arm, f"{arm}@16"], "seed": seed, "figures": figs}

    entries = [
        entry("grpo", 0, 0.60, 0.66, 0.70, True),  # the rule's collapse, but the last three sit near the peak
        entry("grpo", 1, 0.70, 0.68, 0.70, False),
        entry("relaxed", 0, 0.30, 0.35, 0.57, True),
        {"arms": ["mu_grpo@64"], "seed": 0, "figures": {"final_acc": 0.6, "late_acc": 0.6, "peak_acc": 0.6}},
        {"arms": ["p2/grpo"], "seed": 0, "figures": {"final_acc": 0.6, "late_acc": 0.6, "peak_acc": 0.6}},
        {"arms": ["m2po"], "seed": 0, "figures": {"final_acc": math.nan, "late_acc": math.nan, "peak_acc": 0.5}},
    ]
    text = claims.late_table(entries)
    assert "decides nothing" in text
    assert "| grpo | 0.650 | 0.670 | 0.700 | 0 of 2 | 1 of 2 |" in text
    assert "| relaxed | 0.300 | 0.350 | 0.570 | 1 of 1 | 1 of 1 |" in text
    assert "mu_grpo" not in text and "p2/" not in text and "m2po" not in text  # sweep, other phase, no figures
    assert "| p2/grpo |" in claims.late_table(entries, "p2/")
    assert claims.late_table(entries[3:4]) == ""


def test_the_consistency_report_gives_each_seed_and_no_verdict():
    def entry(arm, seed, **figs):
        return {"arms": [f"1m/{arm}", f"1m/{arm}@16"], "seed": seed, "figures": figs}

    entries = [
        entry("grpo", 0, final_acc=0.60, peak_acc=0.65, clip_rise=0.002, acc_256=0.55),
        entry("grpo", 1, final_acc=0.62, peak_acc=0.66, clip_rise=0.003, acc_256=0.50),
        entry("relaxed", 0, final_acc=0.20, peak_acc=0.58, collapsed=True, acc_256=0.52),
        entry("relaxed", 1, final_acc=0.50, peak_acc=0.57, collapsed=False, acc_256=0.54),
        entry("mu_grpo", 0, final_acc=0.55, stable=True),
        entry("mu_grpo", 1, final_acc=0.58, stable=True),
    ]
    text = claims.consistency_report(entries, "1m/")
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| C")}
    assert set(rows) == {"C1a", "C1b", "C2a", "C2b", "C5a", "C5b"}  # the claims these three arms allow
    assert rows["C5a"].endswith("| seed 0: yes, seed 1: yes | yes |")  # no precondition here: no verdicts
    assert rows["C1a"].endswith("| seed 0: +0.002, seed 1: +0.003 | yes |")
    assert rows["C2a"].endswith("| seed 0: yes, seed 1: no | no |")
    assert rows["C2b"].endswith("| seed 0: -0.030, seed 1: +0.040 | no |")  # relaxed − grpo at update 256
    assert "`final_acc`: 1m/mu_grpo − 1m/relaxed > 0" in rows["C5b"] and rows["C5b"].endswith("| yes |")
    assert "reproduced" not in text and "refuted" not in text
    assert claims.consistency_report(entries, "p3/") == ""
