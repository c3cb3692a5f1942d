"""The sample schema: one prompt group of G responses, and its msgpack codec.

A :class:`Group` is the unit that rollout workers produce, the sample queue holds and the trainer
consumes. Invariants (checked on construction and on decode):

- every per-response list (``responses``, ``behavior_logprobs``, ``rewards``, ``advantages``,
  ``finish_reasons``) has length G = ``len(responses)`` >= 1;
- ``len(behavior_logprobs[i]) == len(responses[i])`` for every response i (one behaviour log-prob
  per sampled token, as returned by the engine);
- ``policy_version`` >= 0 is the trainer update count of the weights that generated the group.

Token ids and log-probs are typed arrays in memory (numpy int32 and float32, one array per response: 4 bytes a
token, not a Python object each) and at rest (msgpack bins of their bytes, never pickle); a shard's groups are
packed one by one so that each can be read alone (:func:`encode_groups_indexed`, :mod:`.shards`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import msgpack
import numpy as np

SCHEMA_VERSION = 1


class SampleError(ValueError):
    """A group that violates the schema's invariants."""


@dataclass(eq=False)
class Group:
    """One prompt and its G sampled responses with everything the loss needs.

    Attributes:
        prompt_id: Stable id of the prompt (e.g. the task problem id).
        prompt_ids: Prompt token ids, (P,) int32 (a list is converted on construction).
        answer: Reference answer the rewards were computed against.
        responses: G arrays of sampled token ids, (T_i,) int32 each.
        behavior_logprobs: G arrays of the engine's log-probs of the sampled tokens, (T_i,) float32 each.
        rewards: G rewards R_i.
        advantages: G group-normalised advantages A_i.
        policy_version: Trainer update count of the weights that generated the group.
        finish_reasons: G engine finish reasons ("stop", "length", ...).
        meta: Free-form small metadata (level, worker index, ...); msgpack-serialisable values only.
    """

    prompt_id: str
    prompt_ids: np.ndarray
    answer: str
    responses: list[np.ndarray]
    behavior_logprobs: list[np.ndarray]
    rewards: list[float]
    advantages: list[float]
    policy_version: int
    finish_reasons: list[str]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int32)
        self.responses = [np.asarray(r, dtype=np.int32) for r in self.responses]
        self.behavior_logprobs = [np.asarray(x, dtype=np.float32) for x in self.behavior_logprobs]
        self.validate()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Group):
            return NotImplemented
        return all(_same(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))

    @property
    def group_size(self) -> int:
        return len(self.responses)

    def validate(self) -> None:
        """Raise :class:`SampleError` unless the invariants in the module docstring hold."""
        g = len(self.responses)
        if g < 1:
            raise SampleError(f"group {self.prompt_id}: no responses")
        for name in ("behavior_logprobs", "rewards", "advantages", "finish_reasons"):
            if len(getattr(self, name)) != g:
                raise SampleError(f"group {self.prompt_id}: {name} has {len(getattr(self, name))} entries, G={g}")
        for i, (toks, lps) in enumerate(zip(self.responses, self.behavior_logprobs)):
            if len(toks) != len(lps):
                raise SampleError(
                    f"group {self.prompt_id}: response {i} has {len(toks)} tokens but {len(lps)} log-probs"
                )
            if not np.isfinite(lps).all():
                raise SampleError(f"group {self.prompt_id}: response {i} has a non-finite behaviour log-prob")
        if self.policy_version < 0:
            raise SampleError(f"group {self.prompt_id}: policy_version {self.policy_version} < 0")

    def to_wire(self) -> dict:
        """A msgpack-ready dict (token ids as int32 bytes, log-probs as float32 bytes)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["v"] = SCHEMA_VERSION
        d["prompt_ids"] = self.prompt_ids.tobytes()
        d["responses"] = [r.tobytes() for r in self.responses]
        d["behavior_logprobs"] = [x.tobytes() for x in self.behavior_logprobs]
        d["rewards"], d["advantages"] = [float(r) for r in self.rewards], [float(a) for a in self.advantages]
        return d

    @classmethod
    def from_wire(cls, d: dict) -> Group:
        """Inverse of :meth:`to_wire`; validates the invariants."""
        if d.get("v") != SCHEMA_VERSION:
            raise SampleError(f"unsupported sample schema version {d.get('v')!r}")
        d = dict(d)
        d.pop("v")
        d["prompt_ids"] = np.frombuffer(d["prompt_ids"], dtype=np.int32)
        d["responses"] = [np.frombuffer(r, dtype=np.int32) for r in d["responses"]]
        d["behavior_logprobs"] = [np.frombuffer(x, dtype=np.float32) for x in d["behavior_logprobs"]]
        return cls(**d)


def _same(a, b) -> bool:
    """Equality of two field values, arrays (or lists of arrays) compared by value."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def encode_groups(groups: list[Group]) -> bytes:
    """Serialise groups to one msgpack document (a list of groups)."""
    return encode_groups_indexed(groups)[0]


def encode_groups_indexed(groups: list[Group]) -> tuple[bytes, list[tuple[int, int]]]:
    """:func:`encode_groups`'s document and the (offset, length) of each group's bytes in it.

    A msgpack array is its header followed by its items' encodings, so packing the items one by one gives the same
    document as packing the list, and each item can later be decoded alone from its slice (:func:`decode_group`).
    """
    packer = msgpack.Packer(use_bin_type=True)
    parts, spans, pos = [packer.pack_array_header(len(groups))], [], 0
    pos = len(parts[0])
    for g in groups:
        item = packer.pack(g.to_wire())
        spans.append((pos, len(item)))
        parts.append(item)
        pos += len(item)
    return b"".join(parts), spans


def decode_group(data: bytes | memoryview) -> Group:
    """One group from its own msgpack bytes (a slice given by :func:`encode_groups_indexed`)."""
    try:
        return Group.from_wire(msgpack.unpackb(data, raw=False))
    except SampleError:
        raise
    except (msgpack.UnpackException, ValueError, TypeError, KeyError, AttributeError) as err:
        raise SampleError(f"malformed group: {err}") from None


def decode_groups(data: bytes) -> list[Group]:
    """Inverse of :func:`encode_groups` (raises :class:`SampleError` on a malformed document)."""
    try:
        items = msgpack.unpackb(data, raw=False)
    except (msgpack.UnpackException, ValueError) as err:
        raise SampleError(f"not a msgpack sample document: {err}") from None
    if not isinstance(items, list):
        raise SampleError("sample document must be a list of groups")
    try:
        return [Group.from_wire(d) for d in items]
    except (TypeError, KeyError) as err:
        raise SampleError(f"malformed group: {err}") from None
