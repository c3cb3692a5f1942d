"""What the trainer ranks share through torch.distributed (gloo on CPU, NCCL on GPU): gathers and agreements, and
where each rank computes (its device, backend and environment).

Every collective is a no-op for a single process (or before torch.distributed is initialised), so the same code
runs in unit tests and on one rank. No Ray.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order (all ranks must call it); ``[obj]`` for one process."""
    import torch.distributed as dist

    if _world() == 1:
        return [obj]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def all_ranks_agree(ok: bool) -> bool:
    """True only if every rank says True (one all-reduce of a flag; all ranks must call it)."""
    import torch.distributed as dist

    if _world() == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def strided_share(items: list, rank: int, world_size: int) -> list:
    """Rank ``rank``'s items ``rank, rank + world_size, ...``: an even split for work each rank does once."""
    return items[rank::world_size]


def unstride(parts: list[list], n: int) -> list:
    """Inverse of `strided_share` over all ranks: ``parts[r]`` back into the positions r, r + W, ..., n items."""
    out: list = [None] * n
    for r, part in enumerate(parts):
        out[r :: len(parts)] = part
    return out


@dataclass(frozen=True)
class RankDevice:
    """Where one trainer rank computes and how it reaches the other ranks.

    Attributes:
        local_rank: index of the rank's device among the devices its process sees (``LOCAL_RANK``): 0 when Ray
            narrowed ``CUDA_VISIBLE_DEVICES`` to the rank's GPU, as it does for an actor with ``num_gpus``.
        backend: torch.distributed backend, ``nccl`` on CUDA, else ``gloo``.
        device: ``cuda:<local_rank>`` or ``cpu``.
        gpu_ids: the GPU ids Ray assigned the rank (empty without GPUs; fake ones on a CPU cluster).
    """

    local_rank: int
    backend: str
    device: str
    gpu_ids: tuple[str, ...] = ()

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")


def rank_device(gpu_ids: Sequence, visible_devices: str | None, cuda_available: bool) -> RankDevice:
    """The device of a rank that Ray assigned ``gpu_ids`` (``ray.get_gpu_ids()``; empty for a CPU rank).

    The rank computes on its first assigned GPU, found among its visible devices (``visible_devices``: the
    process's ``CUDA_VISIBLE_DEVICES``): Ray sets that to the assigned ids, so the index is 0 on every rank; with
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` (every GPU visible) it is the id itself. Never the global
    rank: rank r >= 1 sees one device, so ``cuda:r`` does not exist. Without CUDA (a CPU rank, or fake GPUs
    on a CPU-only cluster) the rank computes on the CPU and talks gloo.
    """
    ids = tuple(str(i) for i in gpu_ids)
    if not ids or not cuda_available:
        return RankDevice(0, "gloo", "cpu", ids)
    visible = [d.strip() for d in visible_devices.split(",")] if visible_devices else []
    if ids[0] in visible:
        local = visible.index(ids[0])
    elif not visible and ids[0].isdigit():
        local = int(ids[0])
    else:
        raise RuntimeError(f"GPU {ids[0]} assigned by Ray is not among CUDA_VISIBLE_DEVICES={visible_devices!r}")
    return RankDevice(local, "nccl", f"cuda:{local}", ids)


def rank_env(rank: int, world_size: int, device: RankDevice) -> dict[str, str]:
    """The environment torch.distributed and DeepSpeed read for this rank (before the rendezvous address).

    ``DS_ACCELERATOR`` is chosen here, not guessed by DeepSpeed: on a CUDA-less process that Ray gave (fake)
    GPUs DeepSpeed would look for CUDA.
    """
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(device.local_rank),
            "DS_ACCELERATOR": "cuda" if device.on_cuda else "cpu"}  # fmt: skip


def free_port() -> int:
    """A TCP port free on every interface of this machine now (the rendezvous port rank 0 offers)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
