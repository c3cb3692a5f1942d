"""The ``collective`` weight sync's mechanics: one process group between trainer rank 0 and every engine worker.

The group is its own, apart from DeepSpeed's default group and vLLM's: a ``TCPStore`` served by trainer rank 0
(at its node's address, so the group spans nodes) and a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL``
(GPU) built on it directly, trainer rank 0 as rank 0 and the engines' workers after it. Every collective
call and the store carry ``weight_sync.timeout_s``: a dead member makes the others fail within it instead of
hanging.

A sync: rank 0 puts the bucket plan and the policy version in the store under the sync's number, then
broadcasts the buckets one by one from two staging buffers (packing bucket b+1 while bucket b is on the wire);
each engine worker receives them into one buffer of the whole state (buckets b+1 and b+2 arrive while the engine
loads bucket b) and hands the tensors, as views of it, to vLLM's in-place ``reload_weights``
(:func:`load_into_engine`). Torch only; no Ray, and vLLM only inside the engine's worker.
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

_PREFIX = "mugrpo-weight-sync"


@dataclass
class WeightGroup:
    """One member's handle on the group: the process group, the store, and its reusable buffers."""

    pg: object
    store: object
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float
    buffers: list = field(default_factory=list)

    def broadcast(self, tensor: torch.Tensor):
        """Start broadcasting ``tensor`` from rank 0; returns the work to wait on."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        return self.pg.broadcast([tensor], opts)

    def wait(self, work) -> None:
        work.wait(datetime.timedelta(seconds=self.timeout_s))

    def staging(self, count: int, nbytes: int) -> list[torch.Tensor]:
        """``count`` byte buffers of at least ``nbytes`` on the group's device, kept from sync to sync."""
        if len(self.buffers) != count or self.buffers[0].numel() < nbytes:
            self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(count)]
        return self.buffers


def join_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
               bind_host: str = "") -> WeightGroup:  # fmt: skip
    """Join the weight group whose store rank 0 serves at ``host:port`` (rank 0 starts it); blocks until every
    member has joined or ``timeout_s`` has passed. ``bind_host``: this member's own address (gloo)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(_PREFIX, store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        pg, device = dist.ProcessGroupGloo(prefixed, rank, world_size, opts), torch.device("cpu")
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg, device = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts), torch.device("cuda")
    else:
        raise ValueError(f"weight group backend must be gloo or nccl, got {backend!r}")
    return WeightGroup(pg, prefixed, rank, world_size, device, timeout_s)


def leave_group(group: WeightGroup | None) -> None:
    """Drop a member's handles (the process group is freed with them)."""
    if group is not None:
        group.buffers.clear()
        with contextlib.suppress(Exception):
            group.pg.abort()


def _meta_key(sync_id: int) -> str:
    return f"meta/{sync_id}"


def send_state(group: WeightGroup | None, params: dict[str, torch.Tensor], sync_id: int, version: int,
               bucket_bytes: int, gathered: Callable[[list], contextlib.AbstractContextManager],
               finite: Callable[[list], bool]) -> bool:  # fmt: skip
    """Broadcast ``params`` bucket by bucket; every trainer rank calls it, ``group`` is None except on rank 0.

    ``gathered(tensors)``: a context in which the bucket's tensors are whole (ZeRO-3's gather, which every rank
    enters; a null context otherwise). ``finite(tensors)``: the check that weights are finite; the sync
    completes either way (the engines are waiting for every bucket) and the result tells whether it held.
    """
    buckets = param_buckets(params, bucket_bytes)
    if group is not None:
        group.store.set(_meta_key(sync_id), pickle.dumps({"version": version, "buckets": buckets}))
        with contextlib.suppress(Exception):  # the plan of two syncs ago has been read by everyone
            group.store.delete_key(_meta_key(sync_id - 2))
        bufs = group.staging(2, max(map(bucket_nbytes, buckets)))
    works: list = [None, None]
    oks: list[bool] = []

    def send(b: int, bucket: list[Entry], tensors: list) -> None:
        if works[b % 2] is not None:  # staging buffer b % 2 is free once its previous send is done
            group.wait(works[b % 2])
        pack_bucket(bufs[b % 2], bucket, tensors)
        works[b % 2] = group.broadcast(bufs[b % 2][: bucket_nbytes(bucket)])
        oks.append(finite(tensors))  # while the bucket is on the wire

    error = each_gathered(buckets, params, gathered, send if group is not None else None)
    if group is not None and error is None:
        try:
            for work in works:
                if work is not None:
                    group.wait(work)
        except Exception as err:  # noqa: BLE001
            error = err
    if error is not None:
        raise error
    return all(oks)


def pack_bucket(buf: torch.Tensor, bucket: list[Entry], tensors: list) -> None:
    """Copy ``tensors`` (whole) into ``buf`` as bytes at their offsets in ``bucket``."""
    for e, t in zip(bucket, tensors):
        buf[e.offset : e.offset + e.nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))


def receive_state(group: WeightGroup, sync_id: int) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """(policy version, an iterator of (name, tensor)) of sync ``sync_id``; the buckets arrive as it is read.

    Each tensor is a view of the member's receive buffer, valid until the next sync.
    """
    meta = pickle.loads(group.store.get(_meta_key(sync_id)))
    buckets: list[list[Entry]] = meta["buckets"]
    return meta["version"], _received(group, buckets)


def _received(group: WeightGroup, buckets: list[list[Entry]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The buckets' tensors as they arrive, each bucket in its own part of one buffer of the whole state: vLLM's
    layer-wise reload holds a layer's tensors until the layer is complete, and some layers complete only at its
    end (a padded vocabulary's embedding), so no part of the buffer is reused within a sync."""
    sizes = [bucket_nbytes(b) for b in buckets]
    starts = [sum(sizes[:b]) for b in range(len(buckets))]
    (buf,) = group.staging(1, sum(sizes))
    works: dict[int, object] = {}

    def post(b: int) -> None:
        if b < len(buckets):
            works[b] = group.broadcast(buf[starts[b] : starts[b] + sizes[b]])

    post(0)
    post(1)
    for b, bucket in enumerate(buckets):
        group.wait(works.pop(b))
        post(b + 2)  # on the wire while the engine loads bucket b
        part = buf[starts[b] : starts[b] + sizes[b]]
        for e in bucket:
            yield e.name, part[e.offset : e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape)
    for work in works.values():  # the consumer stopped early: drain the wire so the group stays usable
        group.wait(work)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"unknown dtype {name!r} in a weight plan")
    return dt


def load_into_engine(worker, sync_id: int) -> int:
    """In an engine's vLLM worker (``LLM.collective_rpc``): receive sync ``sync_id`` and load it in place with
    vLLM's ``reload_weights`` (layer-wise, re-processing each layer for its kernels), then re-prepack a tied
    output layer; returns the policy version."""
    from mugrpo_async.rollout.engine import refresh_output_layer

    w = getattr(worker, "worker", worker)
    version, weights = receive_state(w.mugrpo_weight_group, sync_id)
    w.reload_weights(weights_iterator=weights)
    refresh_output_layer(worker)
    if w.mugrpo_weight_group.device.type != "cpu":  # a GPU keeps no second copy of the weights between syncs
        w.mugrpo_weight_group.buffers.clear()
    return version


def join_engine(worker, host: str, port: int, first_rank: int, world_size: int, backend: str, timeout_s: float,
                bind_host: str) -> int:  # fmt: skip
    """In an engine's vLLM worker: join the weight group as rank ``first_rank`` + the worker's own rank in its
    engine; returns that rank."""
    w = getattr(worker, "worker", worker)
    leave_group(getattr(w, "mugrpo_weight_group", None))
    rank = first_rank + int(getattr(w, "rank", 0))
    w.mugrpo_weight_group = join_group(host, port, rank, world_size, backend, timeout_s, bind_host)
    return rank


def leave_engine(worker) -> None:
    """In an engine's vLLM worker: leave the weight group."""
    w = getattr(worker, "worker", worker)
    leave_group(getattr(w, "mugrpo_weight_group", None))
    w.mugrpo_weight_group = None
