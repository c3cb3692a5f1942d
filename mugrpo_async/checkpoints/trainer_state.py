"""A trainer rank's share of a checkpoint: what it holds beyond the HF weights, and reading it back.

Each rank writes ``trainer/rank-<r>`` (via `state_io`: tensors as safetensors, the rest as JSON; no pickle): its
optimizer state (ZeRO partitions, fp32 master weights), torch RNG state, update count, the learning-rate
scheduler's position (absent from checkpoints written before the schedule existed: read as the update count), the
layout it was written under (world size, ZeRO stage) and the idle clock's totals. Loading checks the layout first:
optimizer partitions only fit the same number of ranks at the same ZeRO stage.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from mugrpo_async.checkpoints.state_io import StateFormatError, load_tree, save_tree


def save_rank_state(folder: str | Path, rank: int, optimizer_state: dict, num_updates: int, world_size: int,
                    zero_stage: int, clock: dict, lr_scheduler: dict | None = None) -> None:  # fmt: skip
    """Write rank ``rank``'s tree (see the module docstring) into checkpoint ``folder``; ``clock``: the idle
    clock's ``state()``; ``lr_scheduler``: `mugrpo_async.training.lr_schedule.scheduler_state`."""
    tree = {"optimizer": optimizer_state, "torch_rng": torch.get_rng_state(), "num_updates": num_updates,
            "world_size": world_size, "zero_stage": zero_stage, **clock}  # fmt: skip
    if lr_scheduler is not None:
        tree["lr_scheduler"] = lr_scheduler
    save_tree(tree, Path(folder) / "trainer" / f"rank-{rank}")


def load_trainer_tree(folder: str | Path, rank: int, optimizer_template: dict, world_size: int, zero_stage: int):
    """Rank ``rank``'s tree from checkpoint ``folder``; raises StateFormatError if written under another layout."""
    folder = Path(folder)
    tree = load_tree(folder / "trainer" / f"rank-{rank}", template={"optimizer": optimizer_template})
    saved = (tree["world_size"], tree["zero_stage"])
    if saved != (world_size, zero_stage):
        raise StateFormatError(f"{folder}: written by {saved[0]} ranks at ZeRO stage {saved[1]}; this run has "
                               f"{world_size} at stage {zero_stage}")  # fmt: skip
    tree.setdefault("lr_scheduler", {"last_epoch": int(tree["num_updates"])})  # one scheduler step per update
    return tree


def read_weights(folder: str | Path, params: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's weights (every ``*.safetensors`` of ``folder``); every name in ``params`` must be there."""
    folder = Path(folder)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    missing = sorted(set(params) - set(weights))
    if missing:
        raise StateFormatError(f"{folder}: weights missing for {missing[:3]}")
    return weights


def restore_optimizer(optimizer, state: dict, rank: int, world_size: int) -> None:
    """Load a rank's saved optimizer state: DeepSpeed's ZeRO / bf16 wrappers take one state per rank (this rank's
    at its index), a plain torch optimizer its own."""
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.load_state_dict(state)
        return
    states = [None] * world_size
    states[rank] = state
    optimizer.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)
