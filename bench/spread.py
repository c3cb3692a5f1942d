"""The run-to-run spread of the benchmark suite: two full runs' figures side by side, in ``RESULTS.md``.

    .venv/bin/python -m bench.run --merge --out bench/RESULTS.md --json bench/data/full-1.json
    .venv/bin/python -m bench.run --out runs/bench/RESULTS-2.md --json bench/data/full-2.json
    .venv/bin/python -m bench.spread bench/data/full-1.json bench/data/full-2.json --out bench/RESULTS.md

Each row of the summary table that both runs measured gets both figures and their spread: the range of the
row's leading figures over the two runs (every repeat's for a row measured per repeat) relative to their mean.
A ratio that differs between two settings by less than this spread does not separate them. The section replaces
an earlier one of the same title in ``--out``, which ``bench.run --merge`` keeps verbatim. Pure text and JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from bench.common import md_table

TITLE = "## Spread over two full runs"
_NUMBER = re.compile(r"^[+-]?\d+(?:\.\d+)?")
_RATIO = re.compile(r"\d+(?:\.\d+)?x")
_ANY_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def leading_figures(figure: str, measured: str) -> list[float]:
    """The numbers a row's spread is taken over: its first figure, or each repeat's for a row of repeats (its figure
    says "per repeat", or it reads like "1.86x / 1.56x": ratios only)."""
    head = measured.split(";")[0]
    parts = head.split(" / ")
    if "per repeat" not in figure and not all(_RATIO.fullmatch(x.strip()) for x in parts):
        parts = [head]
    out = []
    for part in parts:
        if m := _NUMBER.match(part.strip()):
            out.append(float(m.group(0)))
    return out


def relative_range(values: list[float]) -> float | None:
    """(max - min) / |mean|, or None where it is undefined (fewer than two values, or a mean of 0)."""
    if len(values) < 2 or statistics.fmean(values) == 0:
        return None
    return (max(values) - min(values)) / abs(statistics.fmean(values))


def _keys(dump: list[dict]) -> list[tuple[int, str, int]]:
    """Each row's key: its benchmark, its figure with every number blanked (a figure may name a measured value,
    such as a capacity or a sync time), and its occurrence among rows of the same blanked figure."""
    seen: dict[tuple[int, str], int] = {}
    keys = []
    for sec in dump:
        for r in sec["rows"]:
            k = (sec["number"], _ANY_NUMBER.sub("#", r["figure"]))
            seen[k] = seen.get(k, -1) + 1
            keys.append((*k, seen[k]))
    return keys


def spread_rows(first: list[dict], second: list[dict]) -> list[list[str]]:
    """One table row per figure that both dumps hold and both measured, in run 1's order and words."""
    other = dict(zip(_keys(second), (r for s in second for r in s["rows"]), strict=True))
    rows = []
    for key, r in zip(_keys(first), (r for s in first for r in s["rows"]), strict=True):
        r2 = other.get(key)
        if r2 is None or "not measured" in r["measured"] + r2["measured"]:
            continue
        rel = relative_range([x for row in (r, r2) for x in leading_figures(row["figure"], row["measured"])])
        rows.append([str(key[0]), r["figure"], r["measured"], r2["measured"], "-" if rel is None else f"{rel:.0%}"])
    return rows


def section(first: list[dict], second: list[dict], names: tuple[str, str]) -> list[str]:
    """The markdown section: where the two runs came from, their wall times, and the table."""
    walls = [sum(s["data"].get("wall_s", 0.0) for s in dump) / 60 for dump in (first, second)]
    head = ["#", "figure", "run 1", "run 2", "spread (range / mean of the leading figures)"]
    lines = [TITLE, "", f"Run 1: `{names[0]}` ({walls[0]:.0f} min); run 2: `{names[1]}` ({walls[1]:.0f} min), one "
             "after the other on the same machine. The table above is run 1's.", ""]  # fmt: skip
    rows = [[cell.replace("|", "/") for cell in row] for row in spread_rows(first, second)]
    return [*lines, md_table(head, rows), ""]


def replace_section(text: str, body: list[str]) -> str:
    """``text`` with its spread section (to the next ``## `` heading or the end) replaced by ``body``, or
    ``body`` appended."""
    lines = text.rstrip("\n").split("\n")
    start = next((i for i, x in enumerate(lines) if x == TITLE), None)
    if start is None:
        return "\n".join([*lines, "", *body]).rstrip("\n") + "\n"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join([*lines[:start], *body, *lines[end:]]).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.spread", description=__doc__.splitlines()[0])
    parser.add_argument("first", help="run 1's --json dump")
    parser.add_argument("second", help="run 2's --json dump")
    parser.add_argument("--out", default="bench/RESULTS.md", help="the results file to put the section into")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        dumps = [json.loads(Path(p).read_text()) for p in (args.first, args.second)]
    except (OSError, json.JSONDecodeError) as err:
        print(f"error: a run's --json dump could not be read: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    body = section(*dumps, (args.first, args.second))
    out.write_text(replace_section(out.read_text() if out.is_file() else "", body))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
