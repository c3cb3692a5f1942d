"""Integration: a run whose updates turn non-finite stops clearly and keeps its last good checkpoint.

``trainer.lr=1e10`` passes validation (finite, positive) but diverges on the real stack: update 1 moves every
weight by about 1e10 (finite), and from update 2 on the forward pass overflows, so the loss and gradients are NaN.
The guard skips those steps (every rank, no AdamW step), ``trainer.max_nonfinite_updates=2`` skipped in a row stop
the run with exit 3 before their weights are published or checkpointed, and no NaN ever reaches a checkpoint.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from mugrpo_async.reporting.metrics import read_metrics
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_nonfinite_updates_are_skipped_then_stop_the_run_with_the_last_good_checkpoint(tiny_model, tmp_path):
    out = tmp_path / "diverged"
    cmd = [sys.executable, "-m", "launch.train", "--config", "configs/tiny-cpu.yaml", f"model.path={tiny_model}",
           f"run.output_dir={out}", "run.dashboard=false", "logging.progress=false", "trainer.lr=1e10",
           "trainer.max_nonfinite_updates=2", "schedule.total_updates=8", "schedule.mu=8",
           "schedule.groups_per_update=4", "checkpoint.every_updates=1", "checkpoint.keep=8"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error: the run stopped:")]
    assert "updates 2-3: loss or gradient norm not finite" in line and "max_nonfinite_updates=2" in line, line
    updates = read_metrics(out, "update")
    assert [(r["update"], r["nonfinite_skipped"]) for r in updates] == [(1, 0), (2, 1), (3, 1)]
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("update-*"))
    assert ckpts == ["update-00000001", "update-00000002"], ckpts  # nothing after the update that stopped it
    assert f"newest checkpoint: {out / 'checkpoints' / 'update-00000002'}" in line
    first, second = (load_file(str(out / "checkpoints" / c / "model.safetensors")) for c in ckpts)
    initial = load_file(str(tiny_model / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in second.values())
    assert all(torch.equal(first[k], second[k]) for k in first)  # update 2 was skipped: the same weights
    assert max(float((first[k] - initial[k]).abs().max()) for k in first) > 1e6  # update 1 did step (and diverge)
    assert not (out / "checkpoints" / "final").exists() and not read_metrics(out, "stage")
