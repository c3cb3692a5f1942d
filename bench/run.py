"""Run the benchmarks and write ``bench/RESULTS.md``: one command for everything.

    .venv/bin/python -m bench.run [--smoke] [--only 1,3 [--merge]] --out bench/RESULTS.md

Benchmarks (each a module of ``bench/``, tiny config unless stated): 1 staging (GRPO mu=4 vs mu-GRPO, ``staging``),
2 rollout efficiency (``rollout_eff``), 3 weight sync (``weight_sync``), 4 async idle ratio (``async_idle``), 5
trainer efficiency (``trainer_eff``), 6 the TRL peer (``trl_peer``), 7 scaling (``scaling``), 8 staging on the
multi-step task (``staging_reasoning``), 9 engine settings (``engine_settings``). ``--smoke`` runs each at a size
that only checks that it produces its rows (CI runs this through ``tests/test_bench.py``); its timings mean nothing.
Figures are ratios measured side by side in the same invocation; absolute times are context. The load average before
and after is recorded, since other jobs on the machine disturb the figures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from pathlib import Path

from bench import cluster
from bench.common import REPO, Row, Section, load_average, machine, md_table
from bench.merge import merge_results

log = logging.getLogger("bench")
MODULES = {
    1: "staging",
    2: "rollout_eff",
    3: "weight_sync",
    4: "async_idle",
    5: "trainer_eff",
    6: "trl_peer",
    7: "scaling",
    8: "staging_reasoning",
    9: "engine_settings",
}


def run_all(numbers: list[int], smoke: bool) -> list[Section]:
    """Run the chosen benchmarks in order; a benchmark that fails gives one 'not measured' row."""
    cluster.SHARE = smoke  # a smoke run hands actors on between benchmarks (see bench.cluster)
    sections = []
    for n in numbers:
        t0, load_before = time.perf_counter(), load_average()
        log.info("benchmark %d (%s)", n, MODULES[n])
        module = importlib.import_module(f"bench.{MODULES[n]}")
        try:
            sec = module.run(smoke)
        except Exception as err:  # noqa: BLE001 - report the failure as the row, keep the other benchmarks
            log.exception("benchmark %d failed", n)
            sec = Section(
                n,
                MODULES[n],
                [
                    Row(
                        MODULES[n],
                        "-",
                        f"not measured: {type(err).__name__}: {err}"[:300],
                        None,
                        f".venv/bin/python -m bench.run --only {n}",
                    )
                ],
            )
        sec.data["wall_s"] = time.perf_counter() - t0
        sec.data["load"] = (load_before, load_average())
        sections.append(sec)
        log.info("benchmark %d done in %.0fs", n, sec.data["wall_s"])
    return sections


def _mark(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "-"}[met]


def render(sections: list[Section], argv: list[str], info: dict, loads: tuple[str, str], wall: float) -> str:
    """The RESULTS.md text: machine, command, the table, each benchmark's context, the closing note."""
    cmd = ".venv/bin/python -m bench.run " + " ".join(argv)
    out = [
        "# Benchmark results",
        "",
        f"Command: `{cmd}` (all figures below come from this one invocation; {wall / 60:.1f} min wall).",
        "",
        f"Machine: {info['cpu']}; {info['os']}; Python {info['python']}; {info['stack']}. No GPU.",
        "",
        f"Load average (1/5/15 min) before: {loads[0]}; after: {loads[1]}. A load above ~0.5 before the "
        "start means other jobs shared the 2 cores: absolute times then swell, ratios less so.",
        "",
        "Figures are ratios measured side by side in this run; absolute times are context only.",
        "",
    ]
    rows = [
        [s.number, r.figure, r.target, r.measured, _mark(r.met), f"`{r.command}`"] for s in sections for r in s.rows
    ]
    out += [md_table(["#", "figure", "target", "measured", "target met", "command"], rows), ""]
    for s in sections:
        load = s.data.get("load", ("?", "?"))
        out += [f"## {s.number}. {s.title}", "", f"Load average at its start: {load[0]}; at its end: {load[1]}.", ""]
        out += [d + "\n" for d in s.details]
    out += ["## Closing note", ""] + closing_note(sections)
    return "\n".join(out) + "\n"


def closing_note(sections: list[Section]) -> list[str]:
    """Which targets are met, and what limits the others (each missed row's ``limit``)."""
    met = [f"{s.number}: {r.figure} ({r.measured})" for s in sections for r in s.rows if r.met]
    missed = [(s.number, r) for s in sections for r in s.rows if r.met is False]
    unmeasured = [(s.number, r) for s in sections for r in s.rows if r.measured.startswith("not measured")]
    lines = ["Targets met: " + ("; ".join(met) if met else "none") + ".", ""]
    if missed:
        lines.append("Targets missed, and what limits them:")
        lines += [f"- {n}: {r.figure}: {r.measured} against {r.target}. {r.limit}" for n, r in missed]
    lines += [f"- {n}: {r.figure}: {r.measured}" for n, r in unmeasured]
    profile = "`.venv/bin/python -m bench.pyspy_profile --config configs/tiny-cpu.yaml`"
    lines += ["", "Profiles of the staged and async runs, and the optimisations measured before and after: "
              f"[PROFILE.md](PROFILE.md) ({profile})."]  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the rows, not the timings")
    parser.add_argument("--only", default="", help="comma-separated benchmark numbers (default: all)")
    parser.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"), help="the markdown file to write")
    parser.add_argument("--json", default="", help="also write the sections' rows and data as JSON here")
    parser.add_argument("--merge", action="store_true", help="replace only these benchmarks in an existing --out")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    numbers = [int(x) for x in args.only.split(",") if x.strip()] or sorted(MODULES)
    unknown = [n for n in numbers if n not in MODULES]
    if unknown:
        parser.error(f"--only: unknown benchmark(s) {unknown}; valid: {sorted(MODULES)}")
    before, t0 = load_average(), time.perf_counter()
    sections = run_all(numbers, args.smoke)
    text = render(sections, argv, machine(), (before, load_average()), time.perf_counter() - t0)
    if args.merge and Path(args.out).is_file():
        text = merge_results(Path(args.out).read_text(), text, ".venv/bin/python -m bench.run " + " ".join(argv))
    Path(args.out).write_text(text)
    if args.json:
        dump = [
            {"number": s.number, "title": s.title, "rows": [r.__dict__ for r in s.rows], "data": s.data}
            for s in sections
        ]
        Path(args.json).write_text(json.dumps(dump, indent=1, default=str))
    log.info("wrote %s", args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
