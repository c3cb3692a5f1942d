"""The warm start shared by the tiny models built in code: teacher-forced AdamW over batches a builder draws.

Each builder (`mugrpo_async.models.tiny` for the arithmetic task, `mugrpo_async.models.tiny_steps` for the
multi-step one) says how step k's batch is drawn from its spec; the optimizer, the schedule and the loop are here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from transformers import Qwen2ForCausalLM

logger = logging.getLogger(__name__)


def _lr_factor(step: int, spec) -> float:
    """Linear warm-up to 1, then cosine decay to 0.1 at the last step."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def teacher_forced(model: Qwen2ForCausalLM, spec, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
               log_every: int) -> float:  # fmt: skip
    """Teacher-forced AdamW over ``spec.steps`` batches ``batch(step) = (input_ids, labels)``, each (B, T) and
    right-padded (labels -100 off the response), with ``spec``'s lr (warm-up, then cosine decay), weight decay
    and a gradient clip of 1; returns the mean loss of the last 50 steps. No attention mask is needed: padding
    is on the right, so causal attention never lets a real token see it, and its labels are ignored."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, spec))
    model.train()
    recent: list[float] = []
    for step in range(spec.steps):
        input_ids, labels = batch(step)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        recent = (recent + [loss.item()])[-50:]
        if step % log_every == 0 or step == spec.steps - 1:
            logger.info("warm start step %d/%d loss %.4f", step + 1, spec.steps, loss.item())
    model.eval()
    return sum(recent) / len(recent)
