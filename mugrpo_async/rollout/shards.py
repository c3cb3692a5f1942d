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

The writer keeps no group in memory: only a :class:`GroupRef` per group (its shard, byte span and sha256, and the
few values the driver needs without reading it: prompt id, rewards, version, token counts). Whoever trains on a
group reads it alone from its shard when needed (:func:`read_groups`), its own checksum checked, so a stage's
memory on the driver and on every trainer rank is its index, and the groups of the minibatch at hand.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import msgpack

from mugrpo_async.rollout.samples import Group, SampleError, decode_group, decode_groups, encode_groups_indexed

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename (readers see all or nothing)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class GroupRef(NamedTuple):
    """Where one stored group lies, and what is known of it without reading it."""

    path: str  # its shard file
    offset: int  # byte span of its msgpack item in the shard
    nbytes: int
    sha256: str  # of those bytes
    prompt_id: str
    rewards: tuple[float, ...]
    policy_version: int
    worker: int  # meta["worker"]
    response_tokens: int
    prompt_tokens: int

    @classmethod
    def of(cls, group: Group, path: Path, span: tuple[int, int], item: bytes | memoryview) -> GroupRef:
        return cls(str(path), span[0], span[1], hashlib.sha256(item).hexdigest(), group.prompt_id,
                   tuple(float(r) for r in group.rewards), group.policy_version, int(group.meta.get("worker", 0)),
                   sum(len(r) for r in group.responses), len(group.prompt_ids))  # fmt: skip


def read_groups(refs: Sequence[GroupRef]) -> list[Group]:
    """The groups of ``refs``, in order, each read alone from its shard (one open per shard) and checked against
    its sha256; raises :class:`SampleError` naming a shard whose bytes changed or vanished."""
    out: list[Group | None] = [None] * len(refs)
    by_path: dict[str, list[int]] = {}
    for k, ref in enumerate(refs):
        by_path.setdefault(ref.path, []).append(k)
    for path, ks in by_path.items():
        try:
            with open(path, "rb") as f:
                for k in sorted(ks, key=lambda k: refs[k].offset):
                    f.seek(refs[k].offset)
                    item = f.read(refs[k].nbytes)
                    if hashlib.sha256(item).hexdigest() != refs[k].sha256:
                        raise SampleError(f"{path}: group {refs[k].prompt_id} at byte {refs[k].offset} fails its "
                                          "checksum (the shard changed after it was indexed)")  # fmt: skip
                    out[k] = decode_group(item)
        except OSError as err:
            raise SampleError(f"{path}: unreadable ({err})") from None
    return out  # type: ignore[return-value]


def resolve(items: Sequence[Group | GroupRef]) -> list[Group]:
    """``items`` as groups: each :class:`GroupRef` read from its shard (:func:`read_groups`), groups as they are."""
    refs = [k for k, x in enumerate(items) if isinstance(x, GroupRef)]
    if not refs:
        return list(items)  # type: ignore[arg-type]
    out = list(items)
    for k, g in zip(refs, read_groups([items[k] for k in refs])):  # type: ignore[misc]
        out[k] = g
    return out  # type: ignore[return-value]


def _totals(refs: Sequence[GroupRef]) -> dict:
    rewards = [r for g in refs for r in g.rewards]
    return {"groups": len(refs), "responses": len(rewards), "reward_sum": float(sum(rewards)),
            "response_tokens": sum(g.response_tokens for g in refs),
            "prompt_tokens": sum(g.prompt_tokens for g in refs)}  # fmt: skip


class StageWriter:
    """Writes one stage's shards (one per chunk) and keeps its manifest current.

    Attributes:
        refs: chunk index -> the :class:`GroupRef` of every group of each finished chunk (loaded or written).
        corrupt: shard files found corrupt on reopening (their chunks count as missing).
    """

    def __init__(self, stage_dir: str | Path, stage: int | str, config_digest: str, num_chunks: int | None = None,
                 chunk_size: int | None = None):  # fmt: skip
        self.dir = Path(stage_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest = {"stage": stage, "config_digest": config_digest, "complete": False,
                         "plan": {"num_chunks": num_chunks, "chunk_size": chunk_size}, "shards": [],
                         "history": [{"event": "created", "time": time.time()}]}  # fmt: skip
        self.refs: dict[int, list[GroupRef]] = {}
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
                writer.refs[entry["chunk"]] = _index_shard(writer.dir, entry)
                writer.manifest["shards"].append(entry)
            except (OSError, SampleError) as err:
                log.warning("%s: %s; its chunk will be generated again", writer.dir, err)
                writer.corrupt.append(entry["file"])
        writer._flush()
        return writer

    def missing(self) -> list[int]:
        """Chunks of the plan with no good shard yet."""
        return [i for i in range(self.manifest["plan"]["num_chunks"] or 0) if i not in self.refs]

    def add(self, groups: list[Group], chunk: int | None = None, stats: dict | None = None) -> list[GroupRef]:
        """Write one chunk's groups as a shard (``chunk`` defaults to the next index; ``stats`` kept beside it);
        returns their refs."""
        chunk = self.next_chunk() if chunk is None else chunk
        if chunk in self.refs:
            raise SampleError(f"{self.dir}: chunk {chunk} written twice")
        data, spans = encode_groups_indexed(groups)
        name = f"shard-{chunk:05d}.msgpack"
        atomic_write(self.dir / name, data)
        view = memoryview(data)
        self.refs[chunk] = [GroupRef.of(g, self.dir / name, s, view[s[0] : s[0] + s[1]]) for g, s in zip(groups, spans)]
        entry = {"file": name, "chunk": chunk, "groups": len(groups), "bytes": len(data),
                 "sha256": hashlib.sha256(data).hexdigest(), **(stats or {})}  # fmt: skip
        self.manifest["shards"].append(entry)
        self._flush()
        return self.refs[chunk]

    def next_chunk(self) -> int:
        """The index after the highest chunk written (open-ended streams append there)."""
        return max(self.refs, default=-1) + 1

    def all_refs(self) -> list[GroupRef]:
        """The refs of every finished group, in chunk order."""
        return [g for i in sorted(self.refs) for g in self.refs[i]]

    def add_wall(self, seconds: float) -> None:
        """Account wall-clock generation time (summed over the attempts that produced the stage)."""
        self.manifest["rollout_wall_s"] = self.manifest.get("rollout_wall_s", 0.0) + seconds
        self._flush()

    def finish(self) -> None:
        if self.missing():
            raise SampleError(f"{self.dir}: chunks {self.missing()} are missing; the stage is not complete")
        self.manifest["complete"] = True
        self.manifest["totals"] = _totals(self.all_refs())
        self._flush()

    def _flush(self) -> None:
        self.manifest["shards"].sort(key=lambda e: e["chunk"])
        atomic_write(self.dir / MANIFEST, json.dumps(self.manifest, indent=1).encode())


def _checked_bytes(stage_dir: Path, entry: dict) -> tuple[Path, bytes]:
    path = stage_dir / entry["file"]
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise SampleError(f"{path}: checksum mismatch (corrupt or truncated shard)")
    return path, data


def _read_shard(stage_dir: Path, entry: dict) -> list[Group]:
    path, data = _checked_bytes(stage_dir, entry)
    shard = decode_groups(data)
    if len(shard) != entry["groups"]:
        raise SampleError(f"{path}: {len(shard)} groups, manifest says {entry['groups']}")
    return shard


def _index_shard(stage_dir: Path, entry: dict) -> list[GroupRef]:
    """The refs of a finished shard's groups (its sha256 checked, each group decoded and validated once, one at a
    time: the shard's bytes are the most this holds)."""
    path, data = _checked_bytes(stage_dir, entry)
    view, unpacker = memoryview(data), msgpack.Unpacker(raw=False, max_buffer_size=len(data) or 1)
    unpacker.feed(data)
    try:
        refs = []
        for _ in range(unpacker.read_array_header()):
            start = unpacker.tell()
            unpacker.skip()
            span = (start, unpacker.tell() - start)
            item = view[span[0] : span[0] + span[1]]
            refs.append(GroupRef.of(decode_group(item), path, span, item))
    except SampleError:
        raise
    except (msgpack.UnpackException, ValueError) as err:
        raise SampleError(f"{path}: not a shard of groups ({err})") from None
    if len(refs) != entry["groups"]:
        raise SampleError(f"{path}: {len(refs)} groups, manifest says {entry['groups']}")
    return refs


def _manifest_entries(stage_dir: Path) -> tuple[dict, list[dict]]:
    """(manifest, its shard entries in chunk order) of a stage folder; raises :class:`SampleError` without one."""
    try:
        manifest = json.loads((stage_dir / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise SampleError(f"{stage_dir}: no readable {MANIFEST} ({err})") from None
    return manifest, sorted(manifest["shards"], key=lambda e: e.get("chunk", 0))


def read_stage(stage_dir: str | Path) -> tuple[dict, list[Group]]:
    """(manifest, groups in chunk order) of a stage folder; raises :class:`SampleError` naming a bad shard."""
    stage_dir = Path(stage_dir)
    manifest, entries = _manifest_entries(stage_dir)
    return manifest, [g for entry in entries for g in _read_shard(stage_dir, entry)]


def stage_index(stage_dir: str | Path) -> tuple[dict, list[GroupRef]]:
    """(manifest, a ref per group in chunk order) of a complete stage folder, read without writing to it; raises
    :class:`SampleError` when the stage is incomplete or a shard is damaged."""
    stage_dir = Path(stage_dir)
    manifest, entries = _manifest_entries(stage_dir)
    if not manifest.get("complete"):
        raise SampleError(f"{stage_dir}: the stage is not complete")
    return manifest, [ref for entry in entries for ref in _index_shard(stage_dir, entry)]


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
