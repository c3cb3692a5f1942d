"""Training checkpoints on disk: atomic writes, integrity checks, retention, and finding where to resume.

Layout of ``<output_dir>/checkpoints/``::

    update-00000064/          # one checkpoint = an HF folder (transformers and vLLM load it) plus
        config.json, model.safetensors, tokenizer files ...
        trainer/rank-0.json, trainer/rank-0.safetensors   # per rank: optimizer, RNG, update count
        trainer/queue.msgpack                              # async mode: the sample queue's contents
        trainer/state.json    # written last: run position + sha256 and size of every other file
    final/                    # the policy at the end of the run (HF folder only)

A checkpoint is built under ``.update-XXXXXXXX.tmp`` and renamed when ``state.json`` is in place, so a
crash leaves either the whole checkpoint or none. ``state.json`` lists each file's sha256, which makes
a truncated or corrupted checkpoint detectable: :meth:`CheckpointStore.latest_valid` skips it (logged,
and returned in ``skipped``) and falls back to the next older one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STATE_FILE = "trainer/state.json"
FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupt, or belongs to a different configuration."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class Resumable:
    """Where a run can continue from: ``state`` is None when no valid checkpoint exists."""

    path: Path | None = None
    state: dict[str, Any] | None = None
    skipped: list[str] = field(default_factory=list)  # "<folder>: <reason>" for each invalid checkpoint
    found_run: bool = False  # the folder held an earlier run (metrics, rollouts or checkpoints)

    @property
    def update(self) -> int:
        return int(self.state["update"]) if self.state else 0


class CheckpointStore:
    """The run's ``checkpoints/`` folder: begin -> (ranks write) -> commit; newest ``keep`` retained."""

    def __init__(self, run_dir: str | Path, keep: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def path_for(self, update: int) -> Path:
        return self.root / f"update-{update:08d}"

    def begin(self, update: int) -> Path:
        """A fresh temporary folder for the checkpoint after ``update`` updates."""
        tmp = self.root / f".update-{update:08d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "trainer").mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, state: dict[str, Any]) -> Path:
        """Seal ``tmp`` (checksums into state.json, then rename) and prune older checkpoints."""
        files = {}
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            files[str(f.relative_to(tmp))] = {"sha256": _sha256(f), "bytes": f.stat().st_size}
        state = {"format": FORMAT, **state, "files": files}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        final = self.path_for(int(state["update"]))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self.prune()
        return final

    def checkpoints(self) -> list[Path]:
        """Committed checkpoint folders, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("update-*") if p.is_dir())

    def prune(self) -> None:
        for old in self.checkpoints()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
            log.info("removed old checkpoint %s (checkpoint.keep=%d)", old, self.keep)

    def latest_valid(self, config_digest: str | None = None) -> Resumable:
        """The newest checkpoint that verifies; invalid ones are skipped and reported."""
        out = Resumable()
        for path in reversed(self.checkpoints()):
            try:
                state = verify_checkpoint(path)
            except CheckpointError as err:
                log.warning("skipping checkpoint: %s", err)
                out.skipped.append(str(err))
                continue
            if config_digest is not None and state.get("config_digest") != config_digest:
                raise CheckpointError(
                    f"{path} was written by a different configuration (digest {state.get('config_digest')}, "
                    f"this config {config_digest}): use another run.output_dir, or the same config to resume"
                )
            out.path, out.state = path, state
            return out
        return out


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint's state after checking that every listed file exists with its sha256."""
    path = Path(path)
    state_file = path / STATE_FILE
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: no readable {STATE_FILE} ({err})") from None
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {state.get('format')!r}, expected {FORMAT}")
    for name, meta in state.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if f.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"{path}: {name} has {f.stat().st_size} bytes, expected {meta['bytes']} (truncated)")
        if _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{path}: {name} fails its sha256 check (corrupt)")
    return state


def holds_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` already holds (part of) a run: metrics, rollout datasets or checkpoints."""
    run_dir = Path(run_dir)
    return (
        (run_dir / "metrics.jsonl").is_file()
        or any((run_dir / "rollouts").glob("*/manifest.json"))
        or bool(CheckpointStore(run_dir).checkpoints())
    )


def find_resumable(run_dir: str | Path, policy: str, config_digest: str, keep: int = 2) -> Resumable:
    """Apply ``run.resume`` (auto | must | never) to ``run_dir``; what the run continues from.

    Raises:
        CheckpointError: ``never`` and the folder holds a run; ``must`` and it holds none; or the
            newest valid checkpoint belongs to another configuration.
    """
    found = holds_run(run_dir)
    if policy == "never" and found:
        raise CheckpointError(f"{run_dir} already holds a run (run.resume=never): choose another run.output_dir")
    if policy == "must" and not found:
        raise CheckpointError(f"nothing to resume in {run_dir}: no metrics, rollouts or checkpoints there")
    if not found:
        return Resumable()
    for manifest in sorted(Path(run_dir).glob("rollouts/*/manifest.json")):
        digest = json.loads(manifest.read_text()).get("config_digest")
        if digest != config_digest:
            raise CheckpointError(f"{manifest.parent} was generated under another configuration (digest {digest}, "
                                  f"this config {config_digest}): use another run.output_dir")  # fmt: skip
    out = CheckpointStore(run_dir, keep).latest_valid(config_digest)
    out.found_run = True
    return out
