"""Prompt templates for math problems, and their tokenisation into rollout prompts.

The instruction is the one DeepScaleR-style training and the paper use: reason step by step and put
the final answer in ``\\boxed{}`` (the form :func:`mugrpo_async.rewards.boxed_math.boxed_reward` scores). Forms
(``data.template``):

- ``chat``: one user message ``"{problem} {INSTRUCTION}"`` through the tokenizer's own chat template,
  with the generation prompt (the assistant turn) opened.
- ``plain``: ``"Problem: {problem}\\n{INSTRUCTION}\\nSolution:"`` for tokenizers without a chat template.
- ``none``: the problem text as is.
- ``auto``: ``chat`` when ``tokenizer.chat_template`` is set, else ``plain``.

Prompts longer than the token limit are dropped and counted, never truncated.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from mugrpo_async.choices import PROMPT_TEMPLATES
from mugrpo_async.data.loaders import MathRow

log = logging.getLogger(__name__)

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
"""Appended to every problem (``chat`` and ``plain`` forms)."""

PLAIN_FORM = "Problem: {problem}\n{instruction}\nSolution:"
"""The ``plain`` form; ``{problem}`` and ``{instruction}`` are filled in."""

TEMPLATES = PROMPT_TEMPLATES
"""The ``data.template`` names (listed once, in :mod:`mugrpo_async.choices`)."""


def resolve_template(template: str, tokenizer) -> str:
    """The concrete form for ``template``: ``chat``, ``plain`` or ``none`` (``auto`` decided here).

    Raises:
        ValueError: for an unknown name, or ``chat`` with a tokenizer that has no chat template.
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; valid: {', '.join(TEMPLATES)}")
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if template == "auto":
        return "chat" if has_chat else "plain"
    if template == "chat" and not has_chat:
        raise ValueError("data.template `chat`: the tokenizer has no chat_template; use `plain` or `auto`")
    return template


def render_prompt(problem: str, tokenizer, form: str) -> str:
    """The prompt text of one problem in a resolved form (see :func:`resolve_template`)."""
    if form == "none":
        return problem
    if form == "plain":
        return PLAIN_FORM.format(problem=problem, instruction=INSTRUCTION)
    if form == "chat":
        messages = [{"role": "user", "content": f"{problem} {INSTRUCTION}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    raise ValueError(f"unresolved prompt form {form!r}; call resolve_template first")


def tokenize_prompts(
    rows: Sequence[MathRow], tokenizer, template: str, max_prompt_tokens: int
) -> tuple[list[dict], int]:
    """Rollout prompts of ``rows``; returns ``(prompts, number dropped as longer than the limit)``.

    Each prompt is ``{"prompt_id": row.id, "prompt_ids": list[int], "answer": row.answer, "meta": dict}``
    with ``1 <= len(prompt_ids) <= max_prompt_tokens``, in the order of ``rows``; ``meta`` is the row's
    plus ``prompt_tokens``. A chat-rendered text already holds the template's special tokens, so the
    tokenizer adds none; the other forms get the tokenizer's usual ones (e.g. a BOS token).
    """
    form = resolve_template(template, tokenizer)
    texts = [render_prompt(r.problem, tokenizer, form) for r in rows]
    keys = [(r.id, r.answer, r.meta) for r in rows]
    return encode_prompts(texts, keys, tokenizer, form, max_prompt_tokens)


def encode_prompts(
    texts: Sequence[str],
    keys: Sequence[tuple],
    tokenizer,
    form: str,
    max_prompt_tokens: int,
    what: str = "prompts",
    keep_text: bool = False,
) -> tuple[list[dict], int]:
    """Tokenize rendered ``texts`` (``keys``: each text's ``(id, answer, meta)``) into rollout prompts, dropping
    and counting those longer than ``max_prompt_tokens``; ``keep_text`` adds ``prompt_text``."""
    if not texts:
        return [], 0
    ids = tokenizer(list(texts), add_special_tokens=form != "chat")["input_ids"]
    prompts, dropped = [], 0
    for (row_id, answer, meta), text, toks in zip(keys, texts, ids):
        if len(toks) > max_prompt_tokens:
            dropped += 1
            continue
        prompt = {"prompt_id": row_id, "prompt_ids": list(toks), "answer": answer,
                  "meta": dict(meta, prompt_tokens=len(toks))}  # fmt: skip
        prompts.append(prompt | ({"prompt_text": text} if keep_text else {}))
    if dropped:
        log.warning("dropped %d of %d %s longer than %d tokens", dropped, len(texts), what, max_prompt_tokens)
    return prompts, dropped
