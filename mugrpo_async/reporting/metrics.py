"""Metric records: per-update aggregation across ranks, and the run folder's sinks.

``metrics.jsonl`` holds one JSON object per line, each with a ``kind``: ``update`` (one per
optimizer update, the DESIGN.md names), ``stage`` (one per sync stage), ``end`` (run totals). The
same scalars go to TensorBoard (``torch.utils.tensorboard``) when enabled.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mugrpo_async.algo import merge_metrics

# Per-rank sums that become minibatch means, and the count they are divided by.
_MEANS = {"reward_mean": ("reward_sum", "num_rows"), "response_len_mean": ("response_len_sum", "num_rows"),
          "lag_mean": ("lag_sum", "num_rows")}  # fmt: skip


def update_record(rank_metrics: list[dict[str, Any]], update: int, policy_version: int) -> dict[str, Any]:
    """Combine the per-rank metrics of one update into its ``metrics.jsonl`` record.

    Loss-term fractions are recomputed from summed counts (``merge_metrics``); losses add up (each
    rank's loss is already normalised by the whole minibatch); times are the slowest rank's.
    """
    merged = merge_metrics(rank_metrics)
    total = {k: sum(m[k] for m in rank_metrics) for k in ("reward_sum", "response_len_sum", "lag_sum", "num_rows")}
    rec: dict[str, Any] = {"kind": "update", "update": update, "policy_version": policy_version}
    rec["loss"] = sum(m["loss"] for m in rank_metrics)
    rec["grad_norm"] = rank_metrics[0]["grad_norm"]
    for key in ("clip_frac", "nav_veto_frac", "nav_trigger_seq_frac", "ratio_mean_neg_adv", "ratio_mean",
                "ratio_min", "ratio_max", "ratio_ess", "m2po_mask_frac", "kl", "dual_clip_frac"):  # fmt: skip
        if key in merged:
            rec[key] = merged[key]
    for key, (num, den) in _MEANS.items():
        rec[key] = total[num] / max(total[den], 1)
    rec["lag_max"] = max(m["lag_max"] for m in rank_metrics)
    rec["groups_dropped"] = rank_metrics[0].get("groups_dropped", 0)  # algo.drop_equal_reward_groups
    rec["t_wait_s"] = max(m["t_wait_s"] for m in rank_metrics)
    rec["t_step_s"] = max(m["t_step_s"] for m in rank_metrics)
    wait, busy = rank_metrics[0]["cum_wait_s"], rank_metrics[0]["cum_busy_s"]
    rec["trainer_idle_ratio"] = wait / max(wait + busy, 1e-9)
    return rec


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class MetricsSink:
    """Appends records to ``<run_dir>/metrics.jsonl`` and mirrors scalars to TensorBoard.

    ``lines`` counts the records in the file; a checkpoint stores it, and a resumed run opens the
    sink with ``keep_lines`` set to it: records written after that checkpoint (updates the resumed
    run does again) move to ``metrics.discarded.jsonl``, so the update sequence in metrics.jsonl
    continues without gaps or repeats and nothing already written is lost.
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, keep_lines: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows = self.path.read_text().splitlines(keepends=True) if self.path.is_file() else []
        if keep_lines is not None and len(rows) > keep_lines:
            with (self.path.parent / "metrics.discarded.jsonl").open("a") as f:
                f.writelines(rows[keep_lines:])
            tmp = self.path.with_name(".metrics.jsonl.tmp")
            tmp.write_text("".join(rows[:keep_lines]))
            tmp.replace(self.path)
            rows = rows[:keep_lines]
        self.lines = len(rows)
        self._file = self.path.open("a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self.lines += 1
        if self._tb is not None:
            kind = record.get("kind", "misc")
            step = record.get("update", record.get("stage", 0))
            for key, value in record.items():
                if _finite(value) and key not in ("update", "stage"):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """Records of ``<run_dir>/metrics.jsonl``, optionally only those of one ``kind``."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in rows if kind is None or r.get("kind") == kind]
