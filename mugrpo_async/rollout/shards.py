"""On-disk rollout datasets: msgpack shards plus a JSON manifest per stage.

Layout of ``<output_dir>/rollouts/stage-K/``::

    shard-00000.msgpack   # encode_groups(...) of one chunk of the stage's prompts, written as it arrives
    manifest.json         # stage, config digest, the chunk plan, one entry per finished shard, totals

A stage's prompts are split into a fixed plan of ``num_chunks`` chunks of ``chunk_size`` prompts;
shard ``i`` holds exactly the groups of chunk ``i``. Shards are written under a temporary name and
renamed, and the manifest is rewritten after each shard, so a crash mid-generation keeps every
finished shard. Reopening the folder (:meth:`StageWriter.open`) verifies each listed shard's sha256
and keeps the good ones; a corrupt or truncated shard is reported and its chunk generated again.
The async mode's stream of groups uses the same writer with an open-ended plan. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from mugrpo_async.rollout.samples import Group, SampleError, decode_groups, encode_groups

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename (readers see all or nothing)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _totals(groups: list[Group]) -> dict:
    rewards = [r for g in groups for r in g.rewards]
    return {"groups": len(groups), "responses": len(rewards), "reward_sum": float(sum(rewards)),
            "response_tokens": sum(len(x) for g in groups for x in g.responses),
            "prompt_tokens": sum(len(g.prompt_ids) for g in groups)}  # fmt: skip


class StageWriter:
    """Writes one stage's shards (one per chunk) and keeps its manifest current.

    Attributes:
        groups: chunk index -> the groups of every finished chunk (loaded or written).
        corrupt: shard files found corrupt on reopening (their chunks count as missing).
    """

    def __init__(self, stage_dir: str | Path, stage: int | str, config_digest: str, num_chunks: int | None = None,
                 chunk_size: int | None = None):  # fmt: skip
        self.dir = Path(stage_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest = {"stage": stage, "config_digest": config_digest, "complete": False,
                         "plan": {"num_chunks": num_chunks, "chunk_size": chunk_size}, "shards": [],
                         "history": [{"event": "created", "time": time.time()}]}  # fmt: skip
        self.groups: dict[int, list[Group]] = {}
        self.corrupt: list[str] = []

    @classmethod
    def open(cls, stage_dir: str | Path, stage: int | str, config_digest: str, num_chunks: int | None = None,
             chunk_size: int | None = None) -> StageWriter:  # fmt: skip
        """Resume the stage folder if it holds a manifest for this config, else start it afresh.

        Raises:
            SampleError: the folder holds a stage of another configuration or chunk plan.
        """
        writer = cls(stage_dir, stage, config_digest, num_chunks, chunk_size)
        path = writer.dir / MANIFEST
        if not path.is_file():
            return writer
        old = json.loads(path.read_text())
        if old.get("config_digest") != config_digest:
            raise SampleError(f"{writer.dir}: written by another configuration (digest {old.get('config_digest')})")
        if num_chunks is not None and old.get("plan", {}).get("num_chunks") != num_chunks:
            raise SampleError(f"{writer.dir}: chunk plan {old.get('plan')} differs from {writer.manifest['plan']}")
        writer.manifest = {**old, "complete": False, "shards": []}
        writer.manifest["history"] = old.get("history", []) + [{"event": "reopened", "time": time.time()}]
        for entry in old["shards"]:
            if not (writer.dir / entry["file"]).is_file():
                log.warning("%s: %s is missing; its chunk will be generated again", writer.dir, entry["file"])
                continue
            try:
                writer.groups[entry["chunk"]] = _read_shard(writer.dir, entry)
                writer.manifest["shards"].append(entry)
            except (OSError, SampleError) as err:
                log.warning("%s: %s; its chunk will be generated again", writer.dir, err)
                writer.corrupt.append(entry["file"])
        writer._flush()
        return writer

    def missing(self) -> list[int]:
        """Chunks of the plan with no good shard yet."""
        return [i for i in range(self.manifest["plan"]["num_chunks"] or 0) if i not in self.groups]

    def add(self, groups: list[Group], chunk: int | None = None, stats: dict | None = None) -> Path:
        """Write one chunk's groups as a shard (``chunk`` defaults to the next index; ``stats`` kept beside it)."""
        chunk = self.next_chunk() if chunk is None else chunk
        if chunk in self.groups:
            raise SampleError(f"{self.dir}: chunk {chunk} written twice")
        data = encode_groups(groups)
        name = f"shard-{chunk:05d}.msgpack"
        atomic_write(self.dir / name, data)
        entry = {"file": name, "chunk": chunk, "groups": len(groups), "bytes": len(data),
                 "sha256": hashlib.sha256(data).hexdigest(), **(stats or {})}  # fmt: skip
        self.manifest["shards"].append(entry)
        self.groups[chunk] = groups
        self._flush()
        return self.dir / name

    def next_chunk(self) -> int:
        """The index after the highest chunk written (open-ended streams append there)."""
        return max(self.groups, default=-1) + 1

    def all_groups(self) -> list[Group]:
        """Every finished group, in chunk order."""
        return [g for i in sorted(self.groups) for g in self.groups[i]]

    def add_wall(self, seconds: float) -> None:
        """Account wall-clock generation time (summed over the attempts that produced the stage)."""
        self.manifest["rollout_wall_s"] = self.manifest.get("rollout_wall_s", 0.0) + seconds
        self._flush()

    def finish(self) -> None:
        if self.missing():
            raise SampleError(f"{self.dir}: chunks {self.missing()} are missing; the stage is not complete")
        self.manifest["complete"] = True
        self.manifest["totals"] = _totals(self.all_groups())
        self._flush()

    def _flush(self) -> None:
        self.manifest["shards"].sort(key=lambda e: e["chunk"])
        atomic_write(self.dir / MANIFEST, json.dumps(self.manifest, indent=1).encode())


def _read_shard(stage_dir: Path, entry: dict) -> list[Group]:
    path = stage_dir / entry["file"]
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise SampleError(f"{path}: checksum mismatch (corrupt or truncated shard)")
    shard = decode_groups(data)
    if len(shard) != entry["groups"]:
        raise SampleError(f"{path}: {len(shard)} groups, manifest says {entry['groups']}")
    return shard


def read_stage(stage_dir: str | Path) -> tuple[dict, list[Group]]:
    """(manifest, groups in chunk order) of a stage folder; raises :class:`SampleError` naming a bad shard."""
    stage_dir = Path(stage_dir)
    try:
        manifest = json.loads((stage_dir / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise SampleError(f"{stage_dir}: no readable {MANIFEST} ({err})") from None
    entries = sorted(manifest["shards"], key=lambda e: e.get("chunk", 0))
    return manifest, [g for entry in entries for g in _read_shard(stage_dir, entry)]


def summarize(groups: list[Group]) -> dict:
    """What ``launch.inspect`` prints for a set of groups: counts, tokens, rewards, lengths, versions."""
    lengths = [len(x) for g in groups for x in g.responses]
    finish: dict[str, int] = {}
    for g in groups:
        for f in g.finish_reasons:
            finish[f] = finish.get(f, 0) + 1
    t = _totals(groups)
    versions = sorted({g.policy_version for g in groups})
    return {**t, "reward_mean": t["reward_sum"] / max(t["responses"], 1),
            "response_len_mean": sum(lengths) / max(len(lengths), 1), "response_len_min": min(lengths, default=0),
            "response_len_max": max(lengths, default=0), "finish_reasons": finish,
            "policy_versions": versions if len(versions) <= 4 else [versions[0], "...", versions[-1]]}  # fmt: skip
