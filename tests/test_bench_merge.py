"""``bench.run --merge`` (`bench.merge`): a partial run's benchmarks replace theirs in an existing RESULTS.md."""

from __future__ import annotations

from bench.merge import merge_results


def _results(rows: dict[int, str], note_extra: str = "") -> str:
    lines = ["# Benchmark results", "", "Command: `x`.", "",
             "| # | figure | target | measured | target met | command |", "|---|---|---|---|---|---|"]  # fmt: skip
    mark = {"good": "met"}
    lines += [f"| {n} | fig {n} | >= 1 | {m} | {mark.get(m, '**missed**')} | `c` |" for n, m in rows.items()]
    lines.append("")
    for n, m in rows.items():
        lines += [f"## {n}. Bench {n}", "", f"Section {n} says {m}.", ""]
    met = "; ".join(f"{n}: fig {n} ({m})" for n, m in rows.items() if m == "good") or "none"
    lines += ["## Closing note", "", f"Targets met: {met}.", "", "Targets missed, and what limits them:"]
    lines += [f"- {n}: fig {n}: {m} against >= 1. limit {n}" for n, m in rows.items() if m != "good"]
    lines += ["", "Profiles: PROFILE.md.", ""] + ([note_extra] if note_extra else [])
    return "\n".join(lines) + "\n"


def test_merge_replaces_only_the_new_benchmarks_and_keeps_the_rest():
    extra = "## Spread over two runs\n\n- a bullet that stays\n\nText that stays.\n"
    old = _results({1: "good", 2: "bad", 3: "bad"}, extra)
    new = _results({2: "good", 8: "bad"})
    out = merge_results(old, new, "bench.run --only 2,8 --merge")
    assert "| 2 | fig 2 | >= 1 | good | met |" in out and "| 2 | fig 2 | >= 1 | bad |" not in out
    assert out.index("| 1 |") < out.index("| 2 |") < out.index("| 3 |") < out.index("| 8 |")
    assert "Section 2 says good." in out and "Section 2 says bad." not in out and "Section 8 says bad." in out
    assert "Targets met: 1: fig 1 (good); 2: fig 2 (good)." in out
    assert "- 3: fig 3: bad" in out and "- 8: fig 8: bad" in out and "- 2: fig 2" not in out
    assert out.endswith(extra) and "Profiles: PROFILE.md." in out
    assert "Sections 2, 8: from `bench.run --only 2,8 --merge`" in out
    assert merge_results(out, new, "bench.run --only 2,8 --merge") == out  # merging again changes nothing


def test_a_full_run_replaces_everything_but_the_text_after_the_closing_note():
    extra = "## What bounds benchmark 2\n\nAn analysis that stays.\n"
    old = _results({1: "good", 2: "bad"}, extra)
    new = _results({1: "bad", 2: "good"}).replace("Command: `x`.", "Command: `y`.")
    out = merge_results(old, new, "bench.run --merge")
    assert out.startswith(new.split("\n## 1.")[0]) and "Command: `x`" not in out and "merged into" not in out
    assert "Section 1 says bad." in out and "Section 2 says good." in out and "Section 1 says good." not in out
    assert "Targets met: 2: fig 2 (good)." in out and "- 1: fig 1: bad" in out
    assert out.endswith(extra) and "\n\n\n" not in out
