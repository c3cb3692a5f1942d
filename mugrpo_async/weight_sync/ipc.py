"""The ``cuda_ipc`` weight sync's mechanics: on colocated devices each engine worker reads the new weights straight
from the memory of the trainer rank on its own device, bucket by bucket; no network, no object store.

Every trainer rank and every engine worker opens one store, a ``TCPStore`` served by trainer rank 0 (the control
plane only; no process group). A member is known by its *device key*: the GPU's UUID on CUDA, on CPU the node's
address and the device index of the colocated layout (trainer rank r and engine i's worker j share device
r = i*k + j, `mugrpo_async.placement`). A sync:

- every trainer rank gathers bucket b (ZeRO-3: every rank enters every gather; all ranks then hold the whole
  bucket), copies it into one of two staging buffers of its own device and puts a handle to that buffer in the
  store under the sync, its device key and b;
- each engine worker waits for its device's handle, copies the bucket out (a device-local copy: vLLM's layer-wise
  reload may hold a layer's tensors until a later bucket completes the layer), acks, and hands the tensors to
  vLLM's in-place ``reload_weights`` (:func:`load_into_engine`);
- a rank refills a staging buffer once every reader of its device has acked the bucket it held, so two buckets
  are in flight; the send returns when every bucket is acked.

Handles: CUDA IPC on GPU (``torch.multiprocessing.reductions.reduce_tensor``, opened on the reader's own device
index, as CUDA_VISIBLE_DEVICES numbers devices per process), and on CPU a shared-memory segment (torch's
file_system sharing through ``torch_shm_manager``), so the same protocol runs on CPU in tests and benchmark 3.
Every wait carries ``weight_sync.timeout_s``. Torch only; vLLM only inside the engine's worker.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mugrpo_async.weight_sync.buckets import Entry, bucket_nbytes, each_gathered, param_buckets
from mugrpo_async.weight_sync.group import _dtype, pack_bucket

_PREFIX = "mugrpo-ipc"


@dataclass
class IpcMember:
    """One member's handle on the sync: the store, its device key, and (trainer) its staging buffers with their
    handles or (engine worker) its reader number and the buffers it has opened."""

    store: object
    key: str
    timeout_s: float
    reader: int = -1
    slots: list = field(default_factory=list)
    handles: list = field(default_factory=list)
    opened: dict = field(default_factory=dict)

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)


def device_key(device: torch.device, node: str, index: int) -> str:
    """The identity of the memory a trainer rank and its engine worker share: the GPU's UUID, or on CPU the node and
    the colocated device index."""
    if device.type == "cuda":
        return f"cuda/{torch.cuda.get_device_properties(device).uuid}"
    return f"cpu/{node}/{index}"


def join(host: str, port: int, key: str, timeout_s: float, serve: bool = False, reads: bool = False) -> IpcMember:
    """Open the sync's store at ``host:port`` (``serve``: start it, trainer rank 0) as the member of device ``key``;
    an engine worker (``reads``) registers as a reader of its device."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, is_master=serve, timeout=timeout, wait_for_workers=False)
    member = IpcMember(dist.PrefixStore(_PREFIX, store), key, timeout_s)
    if reads:
        member.reader = int(member.store.add(f"readers/{key}", 1)) - 1
    return member


def leave(member: IpcMember | None) -> None:
    """Drop a member's buffers and handles (a trainer rank's staging memory is freed with them)."""
    if member is not None:
        member.slots.clear()
        member.handles.clear()
        member.opened.clear()


def _handle(buf: torch.Tensor) -> bytes:
    """A handle another process of the same device opens with :func:`_open`."""
    if buf.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return pickle.dumps(("cuda", reduce_tensor(buf)[1]))
    return pickle.dumps(("shm", buf.untyped_storage()._share_filename_cpu_()))


def _open(member: IpcMember, handle: bytes) -> torch.Tensor:
    """The staging buffer behind ``handle`` (opened once per buffer and kept)."""
    if handle not in member.opened:
        if len(member.opened) >= 2:  # the trainer rank has new staging buffers: close the old ones
            member.opened.clear()
        kind, args = pickle.loads(handle)
        if kind == "cuda":
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            args = list(args)
            args[6] = torch.cuda.current_device()  # storage_device: the same GPU under this process's numbering
            member.opened[handle] = rebuild_cuda_tensor(*args)
        else:
            storage = torch.UntypedStorage._new_shared_filename_cpu(*args)
            member.opened[handle] = torch.empty(0, dtype=torch.uint8).set_(storage)
    return member.opened[handle]


def _staging(member: IpcMember, nbytes: int, device: torch.device) -> list[torch.Tensor]:
    """Two staging buffers of at least ``nbytes`` on ``device``, with their handles, kept from sync to sync."""
    if len(member.slots) != 2 or member.slots[0].numel() < nbytes or member.slots[0].device != device:
        member.slots = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        member.handles = [_handle(b) for b in member.slots]
    return member.slots


def _synchronize(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def _wait_acks(member: IpcMember, prefix: str, b: int, readers: int) -> None:
    member.store.wait([f"{prefix}/{b}/ack/{r}" for r in range(readers)], member.timeout)


def _forget(member: IpcMember, prefix: str, buckets: int, readers: int) -> None:
    """Delete a finished sync's keys (every reader acked every bucket)."""
    keys = [f"{prefix}/meta"] + [f"{prefix}/{b}" for b in range(buckets)]
    keys += [f"{prefix}/{b}/ack/{r}" for b in range(buckets) for r in range(readers)]
    for key in keys:
        with contextlib.suppress(Exception):
            member.store.delete_key(key)


def share_state(member: IpcMember, params: dict[str, torch.Tensor], sync_id: int, version: int, bucket_bytes: int,
                device: torch.device, gathered: Callable[[list], contextlib.AbstractContextManager],
                finite: Callable[[list], bool]) -> bool:  # fmt: skip
    """Hand ``params`` to the engine workers of this rank's device, bucket by bucket; every trainer rank calls it.

    ``gathered(tensors)``: a context in which the bucket's tensors are whole (ZeRO-3's gather, entered by every rank
    whatever happens here). ``finite(tensors)``: the check that weights are finite; the sync completes either way
    (the readers wait for every bucket) and the result tells whether it held. Raises when a reader did not ack
    within ``weight_sync.timeout_s``.
    """
    buckets = param_buckets(params, bucket_bytes)
    prefix, readers = f"{sync_id}/{member.key}", int(member.store.add(f"readers/{member.key}", 0))
    if member.handles:  # the previous sync's keys (it ended with every bucket acked)
        _forget(member, f"{sync_id - 1}/{member.key}", len(buckets), readers)
    slots = _staging(member, max(map(bucket_nbytes, buckets)), device)
    member.store.set(f"{prefix}/meta", pickle.dumps({"version": version, "buckets": buckets}))
    oks: list[bool] = []

    def stage(b: int, bucket: list[Entry], tensors: list) -> None:
        if b >= 2:
            _wait_acks(member, prefix, b - 2, readers)  # its staging buffer is free again
        pack_bucket(slots[b % 2], bucket, tensors)
        _synchronize(slots[b % 2])
        member.store.set(f"{prefix}/{b}", member.handles[b % 2])
        oks.append(finite(tensors))  # while the readers copy the bucket out

    error = each_gathered(buckets, params, gathered, stage if readers else None)
    if error is None and readers:
        try:
            for b in range(max(0, len(buckets) - 2), len(buckets)):
                _wait_acks(member, prefix, b, readers)
        except Exception as err:  # noqa: BLE001
            error = err
    if error is not None:
        raise error
    return all(oks)


def read_state(member: IpcMember, sync_id: int) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """(policy version, an iterator of (name, tensor)) of sync ``sync_id`` from this worker's device; the buckets
    are copied out of the trainer rank's staging buffers as the iterator is read."""
    prefix = f"{sync_id}/{member.key}"
    member.store.wait([f"{prefix}/meta"], member.timeout)
    meta = pickle.loads(member.store.get(f"{prefix}/meta"))
    return meta["version"], _read(member, prefix, meta["buckets"])


def _read(member: IpcMember, prefix: str, buckets: list[list[Entry]]) -> Iterator[tuple[str, torch.Tensor]]:
    for b, bucket in enumerate(buckets):
        member.store.wait([f"{prefix}/{b}"], member.timeout)
        part = _open(member, member.store.get(f"{prefix}/{b}"))[: bucket_nbytes(bucket)].clone()
        _synchronize(part)
        member.store.set(f"{prefix}/{b}/ack/{member.reader}", b"1")
        for e in bucket:
            yield e.name, part[e.offset : e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape)


def load_into_engine(worker, sync_id: int) -> int:
    """In an engine's vLLM worker (``LLM.collective_rpc``): read sync ``sync_id`` from the trainer rank of this
    worker's device and load it in place (``reload_weights``), then re-prepack a tied output layer; returns the
    policy version."""
    from mugrpo_async.rollout.engine import refresh_output_layer

    w = getattr(worker, "worker", worker)
    version, weights = read_state(w.mugrpo_ipc, sync_id)
    w.reload_weights(weights_iterator=weights)
    refresh_output_layer(worker)
    return version


def join_engine(worker, host: str, port: int, first_index: int, timeout_s: float, node: str) -> str:
    """In an engine's vLLM worker: open the sync's store as a reader of this worker's device (colocated index
    ``first_index`` + the worker's rank in its engine); returns the device key."""
    w = getattr(worker, "worker", worker)
    leave(getattr(w, "mugrpo_ipc", None))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    key = device_key(device, node, first_index + int(getattr(w, "rank", 0)))
    w.mugrpo_ipc = join(host, port, key, timeout_s, reads=True)
    return key


def leave_engine(worker) -> None:
    """In an engine's vLLM worker: leave the sync (its opened buffers are closed)."""
    w = getattr(worker, "worker", worker)
    leave(getattr(w, "mugrpo_ipc", None))
    w.mugrpo_ipc = None
