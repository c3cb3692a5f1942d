"""The non-finite guard: an optimizer step whose loss or gradients are not finite never happens.

A NaN or inf loss (or gradient) turns every weight it touches into NaN in one AdamW step; those weights would be
broadcast to the engines and checkpointed. The guard wraps the step of the optimizer that DeepSpeed drives (the
client optimizer: DeepSpeed's ZeRO and bf16 wrappers call its ``step`` on this rank's partition of the fp32 master
weights, after gradient clipping). Before stepping it checks that this rank's loss was finite and that every
gradient it holds is finite (a finite gradient norm, computed without overflow), agrees with the other ranks (one
all-reduce of a flag: every rank steps or none does), and skips the step otherwise. DeepSpeed's own overflow check
(ZeRO 1-3 in fp32 and bf16) may skip the step before the guard is reached; either way ``stepped`` stays False, so
the trainer reads one flag. Pure torch, no Ray and no DeepSpeed; tested on a plain torch optimizer.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch


def grads_finite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient the optimizer would apply is finite (parameters without a gradient are skipped)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return True
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())


class NonFiniteGuard:
    """Wraps ``optimizer.step`` so that a step with a non-finite loss or gradient is skipped on every rank.

    Use per update: :meth:`begin` before the update's backward passes, :meth:`report_loss` for each micro-batch
    loss, then the framework's step (which calls the wrapped step at the accumulation boundary, or skips it
    itself); :attr:`stepped` tells whether the optimizer stepped.

    Args:
        optimizer: the optimizer whose ``step`` is wrapped (in place).
        agree: combines this rank's verdict with the other ranks' (True only if every rank's is True); the
            identity when there is one rank.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, agree: Callable[[bool], bool] = lambda ok: ok):
        self.optimizer, self.agree = optimizer, agree
        self._inner_step = optimizer.step
        # A method of the optimizer (not of the guard): a torch LR scheduler re-binds ``optimizer.step``'s function
        # to the optimizer when it wraps it, and this one still finds its guard then.
        optimizer._nonfinite_guard = self
        optimizer.step = types.MethodType(_guarded_step, optimizer)
        self.loss_finite, self.stepped = True, False

    def begin(self) -> None:
        """A new update starts: no loss seen yet, no step taken."""
        self.loss_finite, self.stepped = True, False

    def report_loss(self, loss: torch.Tensor) -> None:
        """Record a micro-batch's loss (a scalar tensor; read without gradient)."""
        self.loss_finite = self.loss_finite and bool(torch.isfinite(loss.detach()).all())

    def _step(self, *args, **kwargs):
        ok = self.agree(self.loss_finite and grads_finite(self.optimizer))
        if not ok:
            return None
        self.stepped = True
        return self._inner_step(*args, **kwargs)


def _guarded_step(optimizer: torch.optim.Optimizer, *args, **kwargs):
    return optimizer._nonfinite_guard._step(*args, **kwargs)


def params_finite(params) -> bool:
    """Whether every value of these parameters is finite (checked before weights leave the trainer)."""
    return all(bool(torch.isfinite(p.detach()).all()) for p in params)
