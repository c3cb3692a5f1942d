"""``bench.spread``: two full benchmark runs side by side, with each figure's run-to-run spread."""

from __future__ import annotations

import json

import pytest

from bench.spread import TITLE, leading_figures, main, relative_range, spread_rows


def _dump(measured: dict[str, str], wall: float = 60.0) -> list[dict]:
    rows = [{"figure": f, "target": "-", "measured": m, "met": None, "command": "c", "limit": ""}
            for f, m in measured.items()]  # fmt: skip
    return [{"number": 8, "title": "staging", "rows": rows, "data": {"wall_s": wall}}]


def test_leading_figures_take_every_repeat_only_for_rows_per_repeat():
    assert leading_figures("T_rollout ratio (per repeat)", "1.27x / 1.24x") == [1.27, 1.24]
    assert leading_figures("ratio with a sync", "1.86x / 1.56x") == [1.86, 1.56]  # ratios only: repeats
    assert leading_figures("occupancy async / staged", "0.370 / 0.660 (async)") == [0.37]
    assert leading_figures("idle ratio", "2.69%; steady 1.40%") == [2.69]
    assert leading_figures("settings that win", "none") == []


def test_relative_range():
    assert relative_range([1.0, 1.2]) == pytest.approx(0.2 / 1.1)
    assert relative_range([1.0]) is None and relative_range([1.0, -1.0]) is None


def test_rows_pair_by_figure_and_skip_the_unmeasured():
    first = _dump({"a (per repeat)": "1.2x / 1.4x", "b": "3.0x", "c": "not measured: boom", "d": "1x"})
    second = _dump({"a (per repeat)": "1.3x / 1.0x", "b": "3.0x", "c": "2x"})
    rows = spread_rows(first, second)
    assert [r[1] for r in rows] == ["a (per repeat)", "b"]
    assert rows[0][2:] == ["1.2x / 1.4x", "1.3x / 1.0x", "33%"] and rows[1][4] == "0%"


def test_main_appends_then_replaces_its_section(tmp_path):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "RESULTS.md"
    a.write_text(json.dumps(_dump({"b": "2.0x"})))
    b.write_text(json.dumps(_dump({"b": "1.0x"}, wall=120.0)))
    out.write_text("# Benchmark results\n\n## Closing note\n\nTargets met: none.\n\n## Later analysis\n\nStays.\n")
    main([str(a), str(b), "--out", str(out)])
    text = out.read_text()
    assert text.count(TITLE) == 1 and "(1 min); run 2" in text and "(2 min)" in text and "67%" in text
    b.write_text(json.dumps(_dump({"b": "2.0x"})))
    main([str(a), str(b), "--out", str(out)])
    again = out.read_text()
    assert again.count(TITLE) == 1 and "67%" not in again and "| 0% |" in again and "Stays." in again


def test_rows_whose_figure_names_a_measured_value_still_pair_in_order():
    first = _dump({"idle, 1 worker (capacity 1.74)": "2.0%", "seqs 32 / default": "0.76x", "seqs 64 / default": "0.9x"})
    second = _dump({"idle, 1 worker (capacity 1.61)": "2.5%", "seqs 32 / default": "0.74x", "seqs 64 / default": "1x"})
    rows = spread_rows(first, second)
    assert [r[1] for r in rows] == ["idle, 1 worker (capacity 1.74)", "seqs 32 / default", "seqs 64 / default"]
    assert [r[3] for r in rows] == ["2.5%", "0.74x", "1x"]


def test_a_missing_or_broken_dump_is_a_clear_error_and_leaves_the_results_alone(tmp_path, capsys):
    out, bad = tmp_path / "RESULTS.md", tmp_path / "bad.json"
    out.write_text("# Benchmark results\n")
    bad.write_text("{not json")
    assert main([str(tmp_path / "missing.json"), str(bad), "--out", str(out)]) == 2
    assert main([str(bad), str(bad), "--out", str(out)]) == 2
    assert "could not be read" in capsys.readouterr().err and out.read_text() == "# Benchmark results\n"
