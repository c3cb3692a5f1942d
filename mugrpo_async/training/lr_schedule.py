"""The learning-rate schedule: a linear warmup, then constant (the paper), linear or cosine decay.

Update u (counted from 0) steps with lr x f(u), where with W = ``trainer.lr_warmup_updates`` and U =
``schedule.total_updates``:

- warmup, u < W: f(u) = (u + 1) / W (the first update already moves, the W-th reaches the peak);
- after it, with p = (u - W) / (U - W) in [0, 1): constant f = 1, linear f = 1 - p, cosine f = (1 + cos(pi p)) / 2.

It runs as a torch ``LambdaLR`` that DeepSpeed steps at every accumulation boundary (one step per update); its
position is part of each rank's checkpoint (`mugrpo_async.checkpoints.trainer_state`). Pure torch, no Ray.
"""

from __future__ import annotations

import math

import torch

from mugrpo_async.choices import LR_SCHEDULES


def lr_factor(u: int, warmup: int, schedule: str, total: int) -> float:
    """f(u), the multiplier of the peak lr at update u (see the module docstring)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {list(LR_SCHEDULES)}, got {schedule!r}")
    if u < warmup:
        return (u + 1) / warmup
    p = min((u - warmup) / max(total - warmup, 1), 1.0)
    if schedule == "linear":
        return 1.0 - p
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    return 1.0


def build_lr_scheduler(optimizer, trainer_cfg, total_updates: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` following ``trainer_cfg``'s ``lr_warmup_updates`` and ``lr_schedule``."""
    warmup, schedule = trainer_cfg.lr_warmup_updates, trainer_cfg.lr_schedule
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: lr_factor(u, warmup, schedule, total_updates))


def scheduler_state(scheduler) -> dict:
    """What a checkpoint keeps of the scheduler: its position (updates stepped so far)."""
    return {"last_epoch": int(scheduler.last_epoch)}


def restore_scheduler(scheduler, state: dict) -> None:
    """Put ``scheduler`` back at a saved position and set the optimizer's lr to the one of that position."""
    scheduler.last_epoch = int(state["last_epoch"])
    lrs = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
