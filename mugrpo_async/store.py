"""On-disk rollout datasets: msgpack shards plus a JSON manifest per sync stage.

Layout of ``<output_dir>/rollouts/stage-K/``::

    shard-00000.msgpack   # encode_groups(...) of one rollout batch, written as it arrives
    manifest.json         # {"stage", "config_digest", "complete", "shards": [{file, groups, sha256}]}

Shards are written under a temporary name and renamed, and the manifest is rewritten after each
shard, so a crash mid-generation keeps every finished shard. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from mugrpo_async.samples import Group, SampleError, decode_groups, encode_groups


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class StageWriter:
    """Writes one stage's shards and keeps its manifest current."""

    def __init__(self, stage_dir: str | Path, stage: int, config_digest: str):
        self.dir = Path(stage_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest = {"stage": stage, "config_digest": config_digest, "complete": False, "shards": []}

    def add(self, groups: list[Group]) -> Path:
        data = encode_groups(groups)
        name = f"shard-{len(self.manifest['shards']):05d}.msgpack"
        _atomic_write(self.dir / name, data)
        entry = {"file": name, "groups": len(groups), "sha256": hashlib.sha256(data).hexdigest()}
        self.manifest["shards"].append(entry)
        self._flush()
        return self.dir / name

    def finish(self) -> None:
        self.manifest["complete"] = True
        self._flush()

    def _flush(self) -> None:
        _atomic_write(self.dir / "manifest.json", json.dumps(self.manifest, indent=1).encode())


def read_stage(stage_dir: str | Path) -> tuple[dict, list[Group]]:
    """(manifest, groups) of a stage folder; raises :class:`SampleError` naming a corrupt shard."""
    stage_dir = Path(stage_dir)
    manifest = json.loads((stage_dir / "manifest.json").read_text())
    groups: list[Group] = []
    for entry in manifest["shards"]:
        path = stage_dir / entry["file"]
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise SampleError(f"{path}: checksum mismatch (corrupt or truncated shard)")
        shard = decode_groups(data)
        if len(shard) != entry["groups"]:
            raise SampleError(f"{path}: {len(shard)} groups, manifest says {entry['groups']}")
        groups.extend(shard)
    return manifest, groups
