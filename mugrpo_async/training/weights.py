"""Weights on the wire: a state dict packed into one flat byte buffer.

One contiguous ``uint8`` numpy buffer per broadcast (plus a small list of (name, dtype, shape,
offset) entries) goes through Ray's object store without pickling each tensor, and the receiver
gets zero-copy tensor views of it. bfloat16 has no numpy dtype, so bytes are reinterpreted with
``Tensor.view(dtype)`` on both sides.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64)}


_ALIGN = 64  # bytes; every tensor starts at a multiple of this (views need dtype alignment)


@dataclass
class PackedWeights:
    """A state dict as one byte buffer.

    Attributes:
        version: Policy version (trainer update count) of these weights.
        entries: (name, dtype name, shape, byte offset) per tensor, in state-dict order
            (offsets are 64-byte aligned).
        buffer: (total_bytes,) uint8 array holding every tensor back to back.
    """

    version: int
    entries: list[tuple[str, str, tuple[int, ...], int]]
    buffer: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)


def pack_state_dict(state: dict[str, torch.Tensor], version: int, out: np.ndarray | None = None) -> PackedWeights:
    """Copy every tensor of ``state`` (any device) into one CPU byte buffer.

    ``out``: a uint8 buffer of a previous pack to copy into, used when it has exactly the needed size
    (its pages are already mapped: a fresh buffer of a large model costs as much again in page faults).
    The caller must no longer need what it held.
    """
    entries, offset = [], 0
    for name, t in state.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"weight {name}: unsupported dtype {t.dtype}")
        entries.append((name, dtype, tuple(t.shape), offset))
        offset += -(-(t.numel() * t.element_size()) // _ALIGN) * _ALIGN  # keep every view aligned
    reuse = out is not None and out.dtype == np.uint8 and out.shape == (offset,) and out.flags.writeable
    buffer = out if reuse else np.empty(offset, dtype=np.uint8)
    flat = torch.from_numpy(buffer)
    for (_, _, _, start), t in zip(entries, state.values()):
        n = t.numel() * t.element_size()
        flat[start : start + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
    return PackedWeights(version=version, entries=entries, buffer=buffer)


def unpack_state_dict(packed: PackedWeights) -> dict[str, torch.Tensor]:
    """Tensor views into ``packed.buffer`` (no copy; the buffer may be read-only).

    A buffer fetched zero-copy from Ray's object store is read-only; the views must only be read
    (loading them into a model copies), so torch's non-writable-buffer warning is silenced here.
    """
    if not packed.nbytes:
        flat = torch.empty(0, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(memoryview(packed.buffer), dtype=torch.uint8)
    out = {}
    for name, dtype, shape, start in packed.entries:
        dt = _DTYPES[dtype]
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dt).element_size()
        out[name] = flat[start : start + n].view(dt).view(shape)
    return out
