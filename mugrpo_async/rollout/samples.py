"""The sample schema: one prompt group of G responses, and its msgpack codec.

A :class:`Group` is the unit that rollout workers produce, the sample queue holds and the trainer
consumes. Invariants (checked on construction and on decode):

- every per-response list (``responses``, ``behavior_logprobs``, ``rewards``, ``advantages``,
  ``finish_reasons``) has length G = ``len(responses)`` >= 1;
- ``len(behavior_logprobs[i]) == len(responses[i])`` for every response i (one behaviour log-prob
  per sampled token, as returned by the engine);
- ``policy_version`` >= 0 is the trainer update count of the weights that generated the group.

Data at rest is msgpack only (never pickle): token ids as int32 bytes, log-probs as float32 bytes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import msgpack
import numpy as np

SCHEMA_VERSION = 1


class SampleError(ValueError):
    """A group that violates the schema's invariants."""


@dataclass
class Group:
    """One prompt and its G sampled responses with everything the loss needs.

    Attributes:
        prompt_id: Stable id of the prompt (e.g. the task problem id).
        prompt_ids: Prompt token ids, length P.
        answer: Reference answer the rewards were computed against.
        responses: G lists of sampled token ids (length T_i each).
        behavior_logprobs: G lists of the engine's log-probs of the sampled tokens (length T_i each).
        rewards: G rewards R_i.
        advantages: G group-normalised advantages A_i.
        policy_version: Trainer update count of the weights that generated the group.
        finish_reasons: G engine finish reasons ("stop", "length", ...).
        meta: Free-form small metadata (level, worker index, ...); msgpack-serialisable values only.
    """

    prompt_id: str
    prompt_ids: list[int]
    answer: str
    responses: list[list[int]]
    behavior_logprobs: list[list[float]]
    rewards: list[float]
    advantages: list[float]
    policy_version: int
    finish_reasons: list[str]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

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
            if not all(math.isfinite(x) for x in lps):
                raise SampleError(f"group {self.prompt_id}: response {i} has a non-finite behaviour log-prob")
        if self.policy_version < 0:
            raise SampleError(f"group {self.prompt_id}: policy_version {self.policy_version} < 0")

    def to_wire(self) -> dict:
        """A msgpack-ready dict (token ids as int32 bytes, log-probs as float32 bytes)."""
        d = asdict(self)
        d["v"] = SCHEMA_VERSION
        d["prompt_ids"] = np.asarray(self.prompt_ids, dtype=np.int32).tobytes()
        d["responses"] = [np.asarray(r, dtype=np.int32).tobytes() for r in self.responses]
        d["behavior_logprobs"] = [np.asarray(x, dtype=np.float32).tobytes() for x in self.behavior_logprobs]
        return d

    @classmethod
    def from_wire(cls, d: dict) -> Group:
        """Inverse of :meth:`to_wire`; validates the invariants."""
        if d.get("v") != SCHEMA_VERSION:
            raise SampleError(f"unsupported sample schema version {d.get('v')!r}")
        d = dict(d)
        d.pop("v")
        d["prompt_ids"] = np.frombuffer(d["prompt_ids"], dtype=np.int32).tolist()
        d["responses"] = [np.frombuffer(r, dtype=np.int32).tolist() for r in d["responses"]]
        d["behavior_logprobs"] = [np.frombuffer(x, dtype=np.float32).tolist() for x in d["behavior_logprobs"]]
        return cls(**d)


def encode_groups(groups: list[Group]) -> bytes:
    """Serialise groups to one msgpack document."""
    return msgpack.packb([g.to_wire() for g in groups], use_bin_type=True)


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
