"""The staleness study's markdown tables: every variant's settings and figures (mean ± std over seeds), and one
table per sweep (the paper's Table 4 form for mu). Pure; the rows come from
:func:`mugrpo_async.reporting.study.aggregate_variants`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mugrpo_async.reporting.study import GROUPS, mean_std


def _ms(stat: tuple[float, float, int], fmt: str) -> str:
    mean, std, n = stat
    return "-" if n == 0 else f"{mean:{fmt}} ± {std:{fmt}}" if n > 1 else f"{mean:{fmt}}"


def _bound(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:g}"


def _stages(values: list[float], most: int = 8) -> str:
    """Per-stage fractions; more than ``most`` stages are shown as four quarter means."""
    if len(values) > most:
        q = np.array_split(np.asarray(values), 4)
        return "quarters " + " / ".join(f"{np.mean(v):.3f}" for v in q)
    return " / ".join(f"{v:.3f}" for v in values)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table (numeric-looking columns right-aligned)."""
    align = ["---:" if rows and all(r[i][:1].isdigit() or r[i][:1] == "-" for r in rows) else "---"
             for i in range(len(header))]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _acc_header(rows: list[dict]) -> tuple[str, str]:
    held = all(r["acc_source"] == "eval" for r in rows)
    return ("best held-out acc", "final held-out acc") if held else ("best acc*", "final acc*")


def variant_table(rows: list[dict[str, Any]]) -> str:
    """The per-variant table: settings, best / final accuracy, times, clip and veto fractions (mean ± std).

    Accuracy headers end in ``*`` when some variant fell back to the training reward.
    """
    best, final = _acc_header(rows)
    header = ["variant", "bounds", "veto", "mu", best, final, "T_rollout (s)", "T_total (s)", "clip frac",
              "veto frac", "veto frac per stage", "seeds"]  # fmt: skip
    body = [[r["label"], f"[{_bound(r['clip'][0])}, {_bound(r['clip'][1])}]", r["scope"], str(r["mu"]),
             _ms(r["best_acc"], ".3f"), _ms(r["final_acc"], ".3f"), _ms(r["T_rollout"], ".0f"),
             _ms(r["T_total"], ".0f"), _ms(r["clip_frac"], ".4f"), _ms(r["veto_frac"], ".4f"),
             _stages(r["veto_per_stage"]), str(len(r["seeds"]))] for r in rows]  # fmt: skip
    return markdown_table(header, body)


SWEEP_PARAMS = {"mu": ("mu", lambda r: r["mu"]), "clip": ("clip_high", lambda r: r["clip"][1]),
                "tau": ("tau", lambda r: r["tau"])}  # fmt: skip
"""Sweep name -> (column header, the row's swept value)."""


def sweep_table(rows: list[dict[str, Any]], param: str) -> str:
    """One sweep (the paper's Table 4 form for ``mu``): rows sorted by the swept value."""
    head, value = SWEEP_PARAMS[param]
    best, final = _acc_header(rows)
    header = [head, "stages", best, final, "T_rollout (s)", "T_total (s)", "veto frac", "seeds"]
    body = []
    for r in sorted(rows, key=value):
        body.append([_bound(value(r)), str(len(r["veto_per_stage"])),
                     _ms(r["best_acc"], ".3f"), _ms(r["final_acc"], ".3f"), _ms(r["T_rollout"], ".0f"),
                     _ms(r["T_total"], ".0f"), _ms(r["veto_frac"], ".4f"), str(len(r["seeds"]))])  # fmt: skip
    return markdown_table(header, body)


def compute_line(rows: list[dict[str, Any]]) -> str:
    """The study's compute: finished runs and the sum of their wall times (``T_total``, which leaves out each run's
    start-up of about half a minute and the untrained policy's evaluations)."""
    runs = sum(len(r["seeds"]) for r in rows)
    total_s = sum(r["T_total"][0] * r["T_total"][2] for r in rows if r["T_total"][2])
    return f"Compute: {runs} finished runs, {total_s / 3600:.2f} machine-hours of run wall time (sum of T_total).\n"


def study_report(rows: list[dict[str, Any]], initial: list[float] | None = None) -> str:
    """Markdown: the table of every variant, then one table per sweep with at least two of its variants.

    ``initial``: the untrained policy's held-out accuracy per seed, reported above the tables.
    """
    by = {r["variant"]: r for r in rows}
    parts = [compute_line(rows), "## Variants\n", variant_table(rows)]
    if initial:
        parts.insert(0, f"Held-out accuracy before training: {_ms(mean_std(initial), '.3f')} ({len(initial)} seeds)\n")
    for param, names in GROUPS.items():
        chosen = [by[n] for n in names if n in by]
        if param != "core" and len(chosen) >= 2:
            parts += [f"\n## Sweep: {SWEEP_PARAMS[param][0]}\n", sweep_table(chosen, param)]
    if any(r["acc_source"] != "eval" for r in rows):
        parts.append("\n\\* no eval records in some runs: accuracy is the stage rollouts' training reward")
    return "\n".join(parts) + "\n"
