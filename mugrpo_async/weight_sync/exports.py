"""Exports for the ``object_store`` path: the trainer's weights packed into host buffers and handed to Ray's object
store off the update loop.

Two parts, both used by trainer rank 0 (`actors.trainer.TrainerRank.pack_weights` and ``take_weights``):

- :func:`pack_params` packs the live parameters into one :class:`~mugrpo_async.training.weights.PackedWeights`
  bucket by bucket: under ZeRO-3 each bucket is gathered, copied on rank 0 and released before the next, so no
  rank ever holds the whole model twice (the other ranks take part in the gathers and copy nothing); from GPUs
  the copies go to a page-locked buffer without waiting, with one synchronisation at the end.
- :class:`ExportSlots` keeps the packed buffers between the pack, which must run between two updates (the next
  one changes the weights), and the copy into the object store, which runs in the actor's publish thread while
  the next update runs. Two slots: export v+1 can be packed while export v is still being copied; a third waits
  for a slot (what bounds host memory at two copies of the weights).

Torch and numpy only; no Ray.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from mugrpo_async.training.weights import PackedWeights, copy_into, host_buffer, weights_layout
from mugrpo_async.weight_sync.buckets import full_shape, param_buckets


def pack_params(params: dict[str, torch.Tensor], version: int, *, keep: bool, bucket_bytes: int,
                gathered: Callable[[list], contextlib.AbstractContextManager], finite: Callable[[list], bool],
                out: np.ndarray | None = None) -> PackedWeights | None:  # fmt: skip
    """Pack ``params`` (live parameters, possibly ZeRO-3 partitions) into one host buffer; every rank calls it.

    Args:
        keep: whether this rank keeps the packed weights (rank 0); the others only enter the gathers.
        bucket_bytes: the size of the runs of parameters gathered at once (whole transformer blocks).
        gathered: a context in which a bucket's tensors are whole (ZeRO-3's gather; a null context otherwise).
        finite: the check that a bucket's weights are finite (on the keeping rank).
        out: a buffer of an earlier pack to reuse (:func:`~mugrpo_async.training.weights.host_buffer`).

    Returns:
        The packed weights on the keeping rank, None elsewhere.

    Raises:
        FloatingPointError: on the keeping rank, when a weight is not finite (after every gather is done).
    """
    entries, total = weights_layout([(k, p.dtype, full_shape(p)) for k, p in params.items()])
    offsets = {e[0]: e[3] for e in entries}
    on_gpu = any(p.is_cuda for p in params.values())
    buffer = host_buffer(total, out, pinned=on_gpu) if keep else None
    ok = True
    for bucket in param_buckets(params, bucket_bytes):
        tensors = [params[e.name] for e in bucket]
        with gathered(tensors):
            if buffer is not None:
                ok = finite(tensors) and ok
                for e, t in zip(bucket, tensors):
                    copy_into(buffer, offsets[e.name], t)
    if on_gpu and keep:
        torch.cuda.synchronize()
    if not keep:
        return None
    if not ok:
        raise FloatingPointError(f"update {version}: the weights are not finite")
    return PackedWeights(version=version, entries=entries, buffer=buffer)


class ExportSlots:
    """Packed exports waiting for their copy into the object store, in the order they were packed.

    ``acquire`` a slot (blocks while both are in use), pack into its buffer, then ``ready`` (or ``fail``);
    ``take`` the oldest export (blocks until there is one), copy it out, then ``release`` its slot.
    """

    def __init__(self, count: int = 2):
        self._cv = threading.Condition()
        self.buffers: list[np.ndarray | None] = [None] * count
        self._busy: set[int] = set()
        self._ready: deque[tuple[int, PackedWeights | BaseException]] = deque()

    def acquire(self, timeout_s: float) -> tuple[int, np.ndarray | None]:
        """A free slot and the buffer it last held (None: not allocated yet)."""
        with self._cv:
            if not self._cv.wait_for(lambda: len(self._busy) < len(self.buffers), timeout_s):
                raise TimeoutError(f"no export slot free after {timeout_s:.0f}s: earlier exports were never taken")
            slot = min(set(range(len(self.buffers))) - self._busy)
            self._busy.add(slot)
            return slot, self.buffers[slot]

    def ready(self, slot: int, packed: PackedWeights) -> None:
        with self._cv:
            self.buffers[slot] = packed.buffer
            self._ready.append((slot, packed))
            self._cv.notify_all()

    def fail(self, slot: int, error: BaseException) -> None:
        """The pack into ``slot`` failed: its ``take`` raises ``error``."""
        with self._cv:
            self._ready.append((slot, error))
            self._cv.notify_all()

    def take(self, timeout_s: float) -> tuple[int, PackedWeights]:
        """The oldest packed export and its slot (to ``release`` once copied out); raises a failed pack's error."""
        with self._cv:
            if not self._cv.wait_for(lambda: bool(self._ready), timeout_s):
                raise TimeoutError(f"no packed export after {timeout_s:.0f}s")
            slot, item = self._ready.popleft()
        if isinstance(item, BaseException):
            self.release(slot)
            raise item
        return slot, item

    def release(self, slot: int) -> None:
        with self._cv:
            self._busy.discard(slot)
            self._cv.notify_all()

    @property
    def waiting(self) -> int:
        """Packed exports not yet taken."""
        with self._cv:
            return len(self._ready)
