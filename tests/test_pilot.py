"""Unit: the learning-rate pilot's rules (`mugrpo_async.reporting.pilot`) and its report (`launch.pilot`) from run
folders' records."""

from __future__ import annotations

import json

import pytest

from launch import pilot as cli
from mugrpo_async.reporting.pilot import (
    HIGHER,
    LOWER,
    RateResult,
    decide,
    improves_steadily,
    rate_result,
    veto_in_range,
)

UPDATES = range(64, 1025, 64)


def _curve(start: float, end: float) -> dict[int, float]:
    """Held-out points rising linearly from ``start`` (update 64) to ``end`` (update 1024)."""
    return {u: start + (end - start) * (i / 15) for i, u in enumerate(UPDATES)}


def test_improves_steadily_checks_gain_collapse_and_late_against_early():
    assert improves_steadily(_curve(0.20, 0.30), initial=0.19) == (True, [])
    ok, why = improves_steadily(_curve(0.19, 0.21), initial=0.19)  # last three about 0.207 < 0.22
    assert not ok and "untrained" in why[0]
    peaked = _curve(0.20, 0.40) | {896: 0.33, 960: 0.30, 1024: 0.30}  # peak 0.373 at 832, final 0.30
    ok, why = improves_steadily(peaked, initial=0.19)
    assert not ok and any("collapsed" in w for w in why)
    flat_late = {u: (0.30 if u <= 512 else 0.28) for u in UPDATES}  # late mean below early mean
    ok, why = improves_steadily(flat_late, initial=0.2)
    assert not ok and any("576-1024" in w for w in why)
    with pytest.raises(ValueError, match="896"):
        improves_steadily({64: 0.3}, initial=0.2)


def test_veto_range_is_the_papers():
    assert veto_in_range(0.002) and veto_in_range(0.15) and veto_in_range(0.05)
    assert not veto_in_range(0.0019) and not veto_in_range(0.151)


def _r(lr: float, steady: bool, veto: float) -> RateResult:
    return RateResult(lr, _curve(0.2, 0.3) if steady else _curve(0.2, 0.2), initial=0.19, veto_frac=veto)


def test_decide_follows_the_design():
    assert decide([_r(3e-5, True, 0.01), _r(1e-4, True, 0.02), _r(3e-4, False, 0.2)])["rate"] == 1e-4
    assert decide([_r(3e-5, True, 0.01), _r(1e-4, True, 0.02), _r(3e-4, True, 0.03)])["rate"] == 3e-4
    none = decide([_r(3e-5, False, 0.01), _r(1e-4, False, 0.01)])
    assert none["rate"] is None and none["pilot_next"] == [LOWER]
    stop = decide([_r(LOWER, False, 0.01), _r(3e-5, False, 0.01)])
    assert stop["rate"] is None and stop["pilot_next"] == [] and "does not support" in stop["why"]
    low = decide([_r(3e-5, True, 0.001), _r(1e-4, True, 0.0005)])  # every steady rate under 0.2 %
    assert low["pilot_next"] == [HIGHER]
    after = decide([_r(3e-5, True, 0.001), _r(1e-4, True, 0.0005), _r(HIGHER, False, 0.01)])
    assert after["rate"] == 1e-4 and after["veto_testable"] is False and "not testable" in after["why"]
    high = decide([_r(3e-5, True, 0.2), _r(1e-4, False, 0.3)])  # over the range: used, reported against it
    assert high["rate"] == 3e-5 and high["veto_testable"] is True and "outside" in high["why"]
    waiting = decide([_r(3e-5, True, 0.01), RateResult(1e-4, _curve(0.2, 0.3), 0.19, None)])
    assert waiting["rate"] is None and "not finished" in waiting["why"]


def _write(folder, records):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_report_reads_finished_runs_only_and_a_resumed_runs_newest_records(tmp_path):
    out = tmp_path / "pilot"
    (out / "initial").mkdir(parents=True)
    (out / "initial" / "seed-100.json").write_text(json.dumps({"benchmarks": {"heldout": {"pass@1": 0.19}}}))
    evals = [{"kind": "eval", "update": u, "eval/mean": a} for u, a in _curve(0.2, 0.3).items()]
    _write(out / "a-lr1e-4" / "grpo_mu4" / "seed-100", [{"kind": "eval", "update": 64, "eval/mean": 0.0}, *evals,
                                                         {"kind": "end"}])  # fmt: skip
    updates = [{"kind": "update", "update": u, "nav_veto_frac": 0.5} for u in (1, 2)]  # before a resume
    updates += [{"kind": "update", "update": u, "nav_veto_frac": 0.01} for u in (1, 2, 3)]
    _write(out / "b-lr1e-4" / "mu_grpo" / "seed-100", [*updates, {"kind": "end"}])
    _write(out / "a-lr3e-4" / "grpo_mu4" / "seed-100", evals[:3])  # started, not finished
    args = cli._parser().parse_args(["--config", "unused.yaml", "--out", str(out)])
    decision = cli.report(args, ["1e-4", "3e-4"])
    assert "not finished at lr [0.0003]" in decision["why"]
    saved = json.loads((out / "pilot.json").read_text())
    first = saved["results"][0]
    assert first["veto_frac"] == pytest.approx(0.01) and first["points"]["64"] == pytest.approx(0.2)
    assert saved["results"][1]["points"] == {} and "| 0.0001 | 64: 0.200" in (out / "pilot.md").read_text()
    finished = rate_result(1e-4, [*evals, {"kind": "end"}], [*updates, {"kind": "end"}], 0.19)
    assert decide([finished])["rate"] == 1e-4


def test_a_later_rate_replays_the_finished_stage_and_is_decided_with_the_rates_before_it(tmp_path):
    out = tmp_path / "pilot"
    args = cli._parser().parse_args(["--config", "c.yaml", "--out", str(out), "--rates", "1e-5"])
    assert cli.stage_source(out, ["1e-5"]) == "1e-5"  # nothing piloted yet: its own run generates the stage
    assert "--replay-from" not in cli.study_argv(args, "b", "1e-5", "1e-5")
    _write(out / "b-lr1e-4" / "mu_grpo" / "seed-100", [{"kind": "update", "update": 1, "nav_veto_frac": 0.0}])
    assert cli.stage_source(out, ["1e-5"]) == "1e-5"  # a (b) run that has not finished holds no stage
    _write(out / "b-lr3e-5" / "mu_grpo" / "seed-100", [{"kind": "end"}])
    (out / "a-lr3e-4").mkdir()
    (out / "a-lr3e-4-old").mkdir()  # a copy set aside by hand is not a rate's folder
    assert cli.piloted(out, ["1e-5"]) == ["3e-4", "1e-4", "3e-5", "1e-5"]
    assert cli.stage_source(out, ["1e-5"]) == "3e-5"
    argv = cli.study_argv(args, "b", "1e-5", "3e-5")
    assert argv[argv.index("--replay-from") + 1] == str(out / "b-lr3e-5" / "mu_grpo")
