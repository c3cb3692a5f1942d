"""Prompt pools and the order in which stages draw from them.

A prompt is a dict ``{"prompt_id", "prompt_ids", "answer", "meta"}`` (what rollout workers take).
Prompts longer than ``data.max_prompt_tokens`` are dropped and counted, never truncated.
"""

from __future__ import annotations

import logging
import random

from mugrpo_async.config import Config
from mugrpo_async.task import generate_problems, prompt_text

log = logging.getLogger(__name__)

# The synthetic RL pool uses seeds far from the warm start's so that problem ids never collide.
RL_SEED_OFFSET = 10_000


def synthetic_prompts(cfg: Config, tokenizer) -> tuple[list[dict], int]:
    """Tokenised prompts of the synthetic task; returns (prompts, number dropped as too long)."""
    problems = generate_problems(cfg.data.num_problems, seed=RL_SEED_OFFSET + cfg.run.seed, levels=cfg.data.levels)
    ids = tokenizer([prompt_text(p) for p in problems], add_special_tokens=False)["input_ids"]
    prompts, dropped = [], 0
    for p, toks in zip(problems, ids):
        if len(toks) > cfg.data.max_prompt_tokens:
            dropped += 1
            continue
        prompts.append({"prompt_id": p.id, "prompt_ids": list(toks), "answer": p.answer, "meta": {"level": p.level}})
    if dropped:
        log.warning("dropped %d prompts longer than data.max_prompt_tokens=%d", dropped, cfg.data.max_prompt_tokens)
    if not prompts:
        raise ValueError("no prompt fits data.max_prompt_tokens; raise it")
    return prompts, dropped


class PromptStream:
    """Endless seeded order over a prompt pool: each epoch is a fresh permutation.

    ``take(n)`` returns the next n prompts; the position is a plain integer (``cursor``) so that a
    resumed run can continue where it stopped.
    """

    def __init__(self, prompts: list[dict], seed: int, cursor: int = 0):
        self.prompts, self.seed, self.cursor = prompts, seed, cursor

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            epoch, pos = divmod(self.cursor, len(self.prompts))
            order = self._order(epoch)
            k = min(n - len(out), len(self.prompts) - pos)
            out.extend(self.prompts[i] for i in order[pos : pos + k])
            self.cursor += k
        return out
