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


def weights_layout(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list, int]:
    """The entries (name, dtype name, shape, byte offset) of tensors ``specs`` ((name, dtype, full shape) in
    state-dict order) packed back to back, each 64-byte aligned, and the buffer's size in bytes."""
    entries, offset = [], 0
    for name, dt, shape in specs:
        dtype = str(dt).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"weight {name}: unsupported dtype {dt}")
        entries.append((name, dtype, tuple(shape), offset))
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dt).element_size()
        offset += -(-nbytes // _ALIGN) * _ALIGN  # keep every view aligned
    return entries, offset


def host_buffer(nbytes: int, out: np.ndarray | None = None, pinned: bool = False) -> np.ndarray:
    """A uint8 host buffer of ``nbytes``: ``out`` when it has exactly that size (its pages are already mapped: a
    fresh buffer of a large model costs as much again in page faults), else a new one, page-locked when ``pinned``
    (GPU weights then copy to it by DMA, without a staging copy of the driver's)."""
    if out is not None and out.dtype == np.uint8 and out.shape == (nbytes,) and out.flags.writeable:
        return out
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    return np.empty(nbytes, dtype=np.uint8)


def copy_into(buffer: np.ndarray, offset: int, tensor: torch.Tensor) -> None:
    """Copy ``tensor``'s bytes (any device) into ``buffer`` at ``offset``; from a GPU without waiting (the caller
    synchronizes once, after the last copy)."""
    n = tensor.numel() * tensor.element_size()
    src = tensor.detach().contiguous().view(-1).view(torch.uint8)
    torch.from_numpy(buffer)[offset : offset + n].copy_(src, non_blocking=src.is_cuda)


def pack_state_dict(state: dict[str, torch.Tensor], version: int, out: np.ndarray | None = None) -> PackedWeights:
    """Copy every tensor of ``state`` (any device) into one CPU byte buffer.

    ``out``: a uint8 buffer of a previous pack to copy into, used when it has exactly the needed size
    (:func:`host_buffer`). The caller must no longer need what it held.
    """
    entries, total = weights_layout([(k, t.dtype, tuple(t.shape)) for k, t in state.items()])
    on_gpu = any(t.is_cuda for t in state.values())
    buffer = host_buffer(total, out, pinned=on_gpu)
    for (_, _, _, start), t in zip(entries, state.values()):
        copy_into(buffer, start, t)
    if on_gpu:
        torch.cuda.synchronize()
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
