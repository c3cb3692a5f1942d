"""What the trainer ranks share through torch.distributed (gloo on CPU, NCCL on GPU): gathers and agreements.

Every function is a no-op for a single process (or before torch.distributed is initialised), so the same code
runs in unit tests and on one rank. No Ray.
"""

from __future__ import annotations

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
