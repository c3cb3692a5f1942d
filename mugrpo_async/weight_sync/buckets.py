"""Bucket plans: which tensors of a state dict travel together in one collective broadcast.

A bucket is a run of consecutive tensors (state-dict order) of at most ``bucket_bytes`` bytes, never splitting
one transformer block (``...layers.<i>.``) or one module across two buckets: the receiving engine loads a fused
layer (vLLM's ``qkv_proj`` from ``q_proj``/``k_proj``/``v_proj``) only once all its parts have arrived, so a
bucket's buffer can be reused as soon as the engine has moved past the bucket. A block larger than
``bucket_bytes`` gets a bucket of its own. Pure logic, no torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

_ALIGN = 64  # bytes; every tensor starts at a multiple of this in its bucket (views need dtype alignment)
_BLOCK = re.compile(r"^(.*?\.layers\.\d+)\.")


@dataclass(frozen=True)
class Entry:
    """One tensor of a bucket: name, dtype name (``torch.<name>``), shape, byte offset in the bucket and size."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def unit_of(name: str) -> str:
    """The unit a tensor must share a bucket with: its transformer block, else its module."""
    m = _BLOCK.match(name)
    return m.group(1) if m else name.rsplit(".", 1)[0]


def aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def plan_buckets(tensors: list[tuple[str, str, tuple[int, ...], int]], bucket_bytes: int) -> list[list[Entry]]:
    """Cut ``tensors`` ((name, dtype name, shape, nbytes) in state-dict order) into buckets of whole units.

    Returns:
        The buckets in order, each a list of :class:`Entry` with offsets inside its bucket.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    units: list[list[tuple]] = []
    for t in tensors:
        if units and unit_of(units[-1][-1][0]) == unit_of(t[0]):
            units[-1].append(t)
        else:
            units.append([t])
    buckets: list[list[Entry]] = []
    size = 0
    for unit in units:
        unit_bytes = sum(aligned(t[3]) for t in unit)
        if not buckets or (size and size + unit_bytes > bucket_bytes):
            buckets.append([])
            size = 0
        for name, dtype, shape, nbytes in unit:
            buckets[-1].append(Entry(name, dtype, tuple(shape), size, nbytes))
            size += aligned(nbytes)
    return buckets


def full_shape(param) -> tuple[int, ...]:
    """A parameter's whole shape: DeepSpeed's ``ds_shape`` for a ZeRO-3 partition, else its own."""
    return tuple(getattr(param, "ds_shape", param.shape))


def param_buckets(params: dict, bucket_bytes: int) -> list[list[Entry]]:
    """:func:`plan_buckets` of named parameters (torch tensors, possibly ZeRO-3 partitions: their whole shapes)."""
    sizes = [(name, str(p.dtype).removeprefix("torch."), full_shape(p), math.prod(full_shape(p)) * p.element_size())
             for name, p in params.items()]  # fmt: skip
    return plan_buckets(sizes, bucket_bytes)


def bucket_nbytes(bucket: list[Entry]) -> int:
    """Bytes of a bucket's buffer (its last tensor's end, aligned)."""
    return aligned(bucket[-1].offset + bucket[-1].nbytes) if bucket else 0


def each_gathered(buckets: list[list[Entry]], params: dict, gathered: Callable[[list], AbstractContextManager],
                  body: Callable[[int, list[Entry], list], None] | None) -> Exception | None:  # fmt: skip
    """Enter every bucket's ``gathered(tensors)`` context in order (ZeRO-3's gather: every rank must enter each one,
    whatever happened on the wire) and call ``body(b, bucket, tensors)`` inside it until one raises.

    Returns:
        The error ``body`` raised (its later buckets are still gathered, not sent), or None.
    """
    error: Exception | None = None
    for b, bucket in enumerate(buckets):
        tensors = [params[e.name] for e in bucket]
        with gathered(tensors):
            if body is None or error is not None:
                continue
            try:
                body(b, bucket, tensors)
            except Exception as err:  # noqa: BLE001 - returned: the caller raises it once every gather is done
                error = err
    return error
