"""Held-out accuracy by level and the format rate (a complete last ``\\boxed{}``, right or wrong) in the evaluation
summaries and in the flat keys of the run's eval records."""

from __future__ import annotations

import pytest

from drivers.periodic_eval import _breakdown
from mugrpo_async.evaluation.benchmarks import summarize


def _rec(level: int, rewards: list[float], responses: list[str] | None = None) -> dict:
    rec = {"meta": {"level": level}, "rewards": rewards, "response_tokens": [4] * len(rewards)}
    return rec | ({"responses": responses} if responses is not None else {})


def test_levels_and_format_rate_by_hand():
    records = [
        _rec(1, [1.0, 0.0], ["so \\boxed{7}", "so \\boxed{8}"]),  # wrong but boxed: counts for the format
        _rec(1, [1.0, 1.0], ["\\boxed{3}", "\\boxed{3}"]),
        _rec(3, [0.0, 0.0], ["\\boxed{1", "no answer"]),  # an unclosed box is no answer
    ]
    s = summarize("heldout", records, ks=[1])
    assert s["by_level"] == {1: pytest.approx(0.75), 3: 0.0} and s["pass@1"] == pytest.approx(0.5)
    assert s["format_rate"] == pytest.approx(4 / 6)
    assert _breakdown({"heldout": s}) == {"eval/heldout/level_1": pytest.approx(0.75), "eval/heldout/level_3": 0.0,
                                          "eval/heldout/format_rate": pytest.approx(4 / 6)}  # fmt: skip


def test_records_without_levels_or_texts_and_code_leave_them_out():
    plain = [{"rewards": [1.0], "response_tokens": [2]}]
    s = summarize("math500", plain, ks=[1])
    assert s["by_level"] == {} and s["format_rate"] is None and _breakdown({"math500": s}) == {}
    mixed = [_rec(1, [1.0], ["\\boxed{1}"]), {"rewards": [0.0], "response_tokens": [2], "responses": ["x"]}]
    assert summarize("heldout", mixed, ks=[1])["by_level"] == {}  # one problem without a level: no breakdown
    assert summarize("humaneval", [_rec(1, [1.0], ["def f(): pass"])], ks=[1])["format_rate"] is None


def test_study_table_of_levels_at_the_last_evaluation(tmp_path):
    import json

    from mugrpo_async.reporting.levels import levels_table
    from mugrpo_async.reporting.study import load_run

    runs = []
    for seed, (acc1, acc2, fmt) in enumerate(((0.5, 0.1, 0.9), (0.7, 0.3, 1.0))):
        folder = tmp_path / f"seed-{seed}"
        folder.mkdir()
        (folder / "config.yaml").write_text("run: {}\n")
        early = {"kind": "eval", "update": 4, "eval/heldout/level_1": 0.0, "eval/heldout/format_rate": 0.0}
        last = {"kind": "eval", "update": 8, "eval/heldout/level_1": acc1, "eval/heldout/level_2": acc2,
                "eval/heldout/format_rate": fmt}  # fmt: skip
        (folder / "metrics.jsonl").write_text(json.dumps(early) + "\n" + json.dumps(last) + "\n")
        runs.append(load_run(folder, "mu_grpo", seed))
    table = levels_table({"mu_grpo": runs})
    assert "| variant | format rate | level 1 | level 2 | seeds |" in table
    assert "| mu-GRPO ([0,5] veto S_seq) | 0.950 ± 0.071 | 0.600 ± 0.141 | 0.200 ± 0.141 | 2 |" in table
    (tmp_path / "seed-0" / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "update": 8}) + "\n")
    assert levels_table({"grpo": [load_run(tmp_path / "seed-0", "grpo", 0)]}) == ""  # records without them
