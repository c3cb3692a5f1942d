"""The study report's table of held-out accuracy by level and the format rate (reported without a verdict:
docs/STUDY.md), read from each run's last eval record (``eval/<benchmark>/level_<L>``,
``eval/<benchmark>/format_rate``: :mod:`drivers.periodic_eval`) and averaged over seeds per variant. Pure."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from mugrpo_async.reporting.study import VARIANTS, RunData, mean_std
from mugrpo_async.reporting.study_tables import markdown_table

_LEVEL = re.compile(r"^level_(\d+)$")


def final_breakdown(run: RunData, benchmark: str = "heldout") -> dict[str, float]:
    """``{"level_<L>": acc, ..., "format_rate": rate}`` of the run's last eval record (empty: none there)."""
    if not run.evals:
        return {}
    prefix = f"eval/{benchmark}/"
    last = run.evals[-1]
    return {k[len(prefix) :]: v for k, v in last.items() if k.startswith(prefix) and v is not None}


def levels_table(runs: Mapping[str, Sequence[RunData]], benchmark: str = "heldout") -> str:
    """Markdown: per variant, the format rate and the accuracy of each level at the last evaluation (mean ± std
    over seeds); empty when no run has them."""
    rows = {name: [final_breakdown(r, benchmark) for r in rs] for name, rs in runs.items()}
    levels = sorted({int(m.group(1)) for bs in rows.values() for b in bs for k in b if (m := _LEVEL.match(k))})
    if not levels and not any("format_rate" in b for bs in rows.values() for b in bs):
        return ""

    def cell(values: list[float]) -> str:
        mean, std, n = mean_std(values)
        return "-" if n == 0 else f"{mean:.3f} ± {std:.3f}" if n > 1 else f"{mean:.3f}"

    header = ["variant", "format rate", *(f"level {lv}" for lv in levels), "seeds"]
    body = []
    for name, bs in rows.items():
        label = VARIANTS[name].label if name in VARIANTS else name
        body.append([label, cell([b.get("format_rate") for b in bs]),
                     *(cell([b.get(f"level_{lv}") for b in bs]) for lv in levels), str(len(bs))])  # fmt: skip
    title = f"## Held-out accuracy by level at the last evaluation ({benchmark})\n"
    return title + markdown_table(header, body) + "\n"
