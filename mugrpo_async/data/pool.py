"""Prompt pools and the order in which stages draw from them.

A prompt is a dict ``{"prompt_id", "prompt_ids", "answer", "meta"}`` (what rollout workers take).
Prompts longer than ``data.max_prompt_tokens`` are dropped and counted, never truncated.
"""

from __future__ import annotations

import logging
import random

from mugrpo_async.config import Config
from mugrpo_async.config_rules import SYNTHETIC_SOURCES
from mugrpo_async.data.task import generate_problems, prompt_text

log = logging.getLogger(__name__)

# The synthetic RL pool and the held-out evaluation set use seeds far from the warm start's and from
# each other, so that problem ids never collide.
RL_SEED_OFFSET = 10_000
EVAL_SEED_OFFSET = 20_000


def draw_problems(generate, text_of, cfg: Config, heldout: bool) -> list:
    """The problems of one split: the held-out set (``eval.num_problems``, a seed of its own) or the training pool
    (``data.num_problems``, seeded by ``run.seed``). With ``data.heldout_disjoint`` the pool is the first
    ``data.num_problems`` of its stream whose prompt (``text_of``) is not a held-out one.

    Raises:
        ValueError: when the held-out set leaves too few distinct problems to fill the pool.
    """
    d, n = cfg.data, cfg.data.num_problems
    if heldout:
        return generate(cfg.eval.num_problems, seed=EVAL_SEED_OFFSET, levels=d.levels)
    seed = RL_SEED_OFFSET + cfg.run.seed
    if not d.heldout_disjoint:
        return generate(n, seed=seed, levels=d.levels)
    held = {text_of(p) for p in generate(cfg.eval.num_problems, seed=EVAL_SEED_OFFSET, levels=d.levels)}
    drawn = n
    while True:  # the streams are prefix-stable: a longer draw starts with the shorter one
        problems = generate(drawn, seed=seed, levels=d.levels)
        kept = [p for p in problems if text_of(p) not in held]
        if len(kept) >= n:
            log.info("data.heldout_disjoint: %d of the first %d pool problems left out as held-out prompts",
                     drawn - len(kept), drawn)  # fmt: skip
            return kept[:n]
        if drawn >= 16 * n:
            raise ValueError(f"data.heldout_disjoint: the {len(held)} held-out prompts cover nearly every problem of "
                             f"levels {d.levels}; lower eval.num_problems or add levels")  # fmt: skip
        drawn *= 2


def synthetic_prompts(cfg: Config, tokenizer, heldout: bool = False) -> tuple[list[dict], int]:
    """Tokenised prompts of the synthetic task; returns (prompts, number dropped as too long).

    ``heldout``: the evaluation set instead: ``eval.num_problems`` problems of a seed of their own, the
    same for every ``run.seed`` (so runs of different seeds are scored on one set). Ids never collide
    with the training pool's; the easiest levels have few distinct problems, so their texts recur in it unless
    ``data.heldout_disjoint`` leaves them out of the pool (:func:`draw_problems`).
    """
    if cfg.data.source == "synthetic_steps":
        return steps_prompts(cfg, tokenizer, heldout)
    problems = draw_problems(generate_problems, prompt_text, cfg, heldout)
    if cfg.data.source == "synthetic_code":  # the same problems, answered as Python (mugrpo_async.data.code_task)
        from mugrpo_async.data.code_task import code_prompts

        prompts, dropped = code_prompts(problems, tokenizer, cfg.data.max_prompt_tokens)
        if not prompts and not heldout:
            raise ValueError("no prompt fits data.max_prompt_tokens; raise it")
        return prompts, dropped
    ids = tokenizer([prompt_text(p) for p in problems], add_special_tokens=False)["input_ids"]
    prompts, dropped = [], 0
    for p, toks in zip(problems, ids):
        if len(toks) > cfg.data.max_prompt_tokens:
            dropped += 1
            continue
        prompts.append({"prompt_id": p.id, "prompt_ids": list(toks), "answer": p.answer, "meta": {"level": p.level}})
    if dropped:
        log.warning("dropped %d prompts longer than data.max_prompt_tokens=%d", dropped, cfg.data.max_prompt_tokens)
    if not prompts and not heldout:
        raise ValueError("no prompt fits data.max_prompt_tokens; raise it")
    return prompts, dropped


def steps_prompts(cfg: Config, tokenizer, heldout: bool = False) -> tuple[list[dict], int]:
    """Tokenised prompts of the multi-step task (:mod:`mugrpo_async.data.steps_task`), drawn like
    :func:`synthetic_prompts`; ``meta`` holds the level (the number of steps)."""
    from mugrpo_async.data.prompts import encode_prompts
    from mugrpo_async.data.steps_task import generate_steps_problems
    from mugrpo_async.data.steps_task import prompt_text as steps_prompt_text

    d = cfg.data
    problems = draw_problems(generate_steps_problems, steps_prompt_text, cfg, heldout)
    keys = [(p.id, p.answer, {"level": p.level}) for p in problems]
    texts = [steps_prompt_text(p) for p in problems]
    prompts, dropped = encode_prompts(texts, keys, tokenizer, "none", d.max_prompt_tokens)
    if not prompts and not heldout:
        raise ValueError("no prompt fits data.max_prompt_tokens; raise it")
    return prompts, dropped


def load_prompts(cfg: Config, tokenizer, split: str = "train") -> tuple[list[dict], int]:
    """The configured prompt pool: ``(prompts, number dropped as longer than data.max_prompt_tokens)``.

    ``data.source`` decides: the synthetic sources (``synthetic``, ``synthetic_steps``, ``synthetic_code``) are
    :func:`synthetic_prompts`; ``code_file`` reads code problems
    (:func:`mugrpo_async.data.code_task.load_code_rows`), split and kept like a file; ``file`` reads
    ``data.path`` (:func:`mugrpo_async.data.loaders.load_rows`), shuffles it with ``data.shuffle_seed``, holds
    out the first ``data.heldout_problems`` rows (``split="heldout"`` returns those), keeps at most
    ``data.limit`` training rows and renders them with ``data.template``
    (:func:`mugrpo_async.data.prompts.tokenize_prompts`). Prompts have the shape described in the module
    docstring; malformed rows skipped under ``data.on_bad_row=skip`` are logged, not counted here.

    Raises:
        mugrpo_async.data.loaders.DatasetError: for an unreadable file or a malformed row (naming both).
        ValueError: for an unknown split, or when no prompt fits ``data.max_prompt_tokens``.
    """
    from mugrpo_async.data.loaders import load_rows, shuffle_split
    from mugrpo_async.data.prompts import tokenize_prompts

    d = cfg.data
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}; valid: train, heldout")
    if d.source in SYNTHETIC_SOURCES:  # held-out split: a fixed draw of eval.num_problems problems
        return synthetic_prompts(cfg, tokenizer, heldout=split == "heldout")
    if d.source == "code_file":
        from mugrpo_async.data.code_task import load_code_rows, render_code_prompts

        rows, render = load_code_rows(d.path), render_code_prompts
    else:
        rows, _ = load_rows(d.path, d.format, d.problem_key, d.answer_key, d.on_bad_row)
        render = tokenize_prompts
    train, heldout = shuffle_split(rows, d.shuffle_seed, d.heldout_problems)
    chosen = heldout if split == "heldout" else train[: d.limit or None]
    prompts, dropped = render(chosen, tokenizer, d.template, d.max_prompt_tokens)
    if not prompts:
        raise ValueError(f"no prompt of {d.path} fits data.max_prompt_tokens={d.max_prompt_tokens}; raise it")
    log.info("%s (%s): %d prompts, %d dropped as too long", d.path, split, len(prompts), dropped)
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
