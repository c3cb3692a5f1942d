"""From the rollout engine's outputs to :class:`~mugrpo_async.rollout.samples.Group` objects and eval records.

The engine is vLLM: a request's ``RequestOutput`` holds ``prompt_token_ids`` and ``outputs``, one
``CompletionOutput`` per sample with ``token_ids`` (T ints), ``text``, ``finish_reason`` and, when asked
for with ``logprobs=0``, ``logprobs``: T dicts from token id to an object with a ``logprob`` attribute,
each holding at least the sampled token. This module only reads those attributes (vLLM is imported
lazily, for the sampling parameters), so it is testable with stand-in objects of that shape.

Behaviour log-probs are those of the distribution that sampled the tokens: the engine runs with
``logprobs_mode=`` :data:`ENGINE_LOGPROBS_MODE`, so vLLM returns log-probs computed after every logits
processor that shapes sampling (temperature, top-k/top-p, min-p, penalties), and :func:`sampling_params`
leaves all of those but the temperature neutral. The sampling distribution is then exactly
``softmax(logits / temperature)``, which the trainer reproduces
(:func:`mugrpo_async.training.batching.token_logprobs`).
"""

from __future__ import annotations

import uuid

import numpy as np
import torch

from mugrpo_async.algo import group_advantages, overlong_penalty
from mugrpo_async.rollout.samples import Group

ENGINE_LOGPROBS_MODE = "processed_logprobs"
"""vLLM engine argument ``logprobs_mode``: log-probs of the sampling distribution (after temperature etc.),
not of the raw logits (``raw_logprobs``, vLLM's default)."""

EVAL_TEXT_CHARS = 2000
"""Evaluation responses longer than this keep their first and last halves (the boxed answer is at the end)."""


def sampling_kwargs(n: int, temperature: float, max_tokens: int, *, logprobs: bool, seed: int | None = None) -> dict:
    """Keyword arguments of vLLM's ``SamplingParams`` whose distribution is ``softmax(logits / temperature)`` only.

    Top-k, top-p, min-p and the three penalties are set to their neutral values explicitly (they are not
    exposed in the config): any of them would change the sampling distribution, and with it the
    processed log-probs the engine returns, away from what the trainer computes.

    Args:
        n: samples per prompt (G).
        temperature: > 0 samples; 0 is greedy (then ``n`` must be 1).
        max_tokens: response limit in tokens.
        logprobs: return the sampled token's log-prob at every position (``logprobs=0``), in vLLM's flat form
            (a few lists per response, not a dict and an object per token: a 3k-token response's log-probs then
            cost the engine actor tens of kilobytes, not about a megabyte, and no garbage-collector work).
        seed: per-request sampling seed (None: the engine's generator).
    """
    return dict(
        n=n,
        temperature=temperature,
        max_tokens=max_tokens,
        logprobs=0 if logprobs else None,
        seed=seed,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        flat_logprobs=logprobs,
    )


def sampling_params(n: int, temperature: float, max_tokens: int, *, logprobs: bool, seed: int | None = None):
    """vLLM ``SamplingParams`` built from :func:`sampling_kwargs` (same arguments)."""
    from vllm import SamplingParams

    return SamplingParams(**sampling_kwargs(n, temperature, max_tokens, logprobs=logprobs, seed=seed))


def sampled_logprobs(completion) -> np.ndarray:
    """The log-prob of each sampled token of one ``CompletionOutput``, (T,) float32 with T = ``len(token_ids)``.

    With ``logprobs=0`` vLLM returns, per position, the sampled token's entry: in its flat form (``FlatLogprobs``,
    :func:`sampling_kwargs`) one entry per position, read as one array; else a dict per position.
    """
    lps, ids = completion.logprobs, completion.token_ids
    if lps is None or len(lps) != len(ids):
        raise ValueError("the engine returned no log-prob for some sampled token (sampled with logprobs=0?)")
    flat = getattr(lps, "start_indices", None)
    if flat is not None and len(lps.logprobs) == len(ids) and list(lps.token_ids) == list(ids):
        return np.asarray(lps.logprobs, dtype=np.float32)  # one entry per position, each the sampled token's
    values = (pos[tok].logprob for tok, pos in zip(ids, lps))
    return np.fromiter(values, dtype=np.float32, count=len(ids))


def response_texts(output) -> list[str]:
    """The G response texts of one ``RequestOutput``."""
    return [c.text for c in output.outputs]


def advantage_options(cfg) -> dict:
    """:func:`make_group`'s advantage options from a validated config (``algo.advantage_std_norm``, and
    ``algo.overlong: soft_penalty`` with ``algo.overlong_buffer`` tokens before ``rollout.max_new_tokens``)."""
    a = cfg.algo
    buffer = a.overlong_buffer if a.overlong == "soft_penalty" else 0
    return {"std_norm": a.advantage_std_norm, "overlong_buffer": buffer, "max_tokens": cfg.rollout.max_new_tokens}


def make_group(prompt: dict, output, rewards: list[float], version: int, worker: int, *, std_norm: bool = True,
               overlong_buffer: int = 0, max_tokens: int = 0) -> Group:  # fmt: skip
    """One prompt's :class:`Group` from its engine output and G rewards; advantages by the group rule.

    Args:
        prompt: ``prompt_id``, ``prompt_ids``, ``answer`` and optionally ``meta``.
        output: the prompt's ``RequestOutput``, sampled with ``logprobs=0``.
        rewards: G rewards, aligned with ``output.outputs`` (stored as they are).
        version: policy version of the weights that generated it.
        worker: index of the rollout worker (kept in ``meta`` with a fresh ``uid``).
        std_norm: False for Dr. GRPO's advantages without the std normalisation.
        overlong_buffer, max_tokens: with a buffer > 0, DAPO's soft overlong penalty (`overlong_penalty`) is added
            to each reward before the advantages (the penalties are kept in ``meta["overlong_penalty"]``).
    """
    R = torch.tensor([rewards], dtype=torch.float32)  # (1, G)
    meta = dict(prompt.get("meta", {}), worker=worker, uid=uuid.uuid4().hex[:16])
    if overlong_buffer > 0:
        lengths = torch.tensor([[len(c.token_ids) for c in output.outputs]])
        penalty = overlong_penalty(lengths, max_tokens, overlong_buffer)
        R, meta["overlong_penalty"] = R + penalty, penalty[0].tolist()
    adv = group_advantages(R, std_norm)[0].tolist()  # (1, G) -> G
    return Group(
        prompt_id=prompt["prompt_id"],
        prompt_ids=np.asarray(prompt["prompt_ids"], dtype=np.int32),
        answer=prompt["answer"],
        responses=[np.asarray(c.token_ids, dtype=np.int32) for c in output.outputs],
        behavior_logprobs=[sampled_logprobs(c) for c in output.outputs],
        rewards=list(rewards),
        advantages=adv,
        policy_version=version,
        finish_reasons=[str(c.finish_reason) for c in output.outputs],
        meta=meta,
    )


def clip_text(text: str, limit: int = EVAL_TEXT_CHARS) -> str:
    """``text``, or its first and last ``limit // 2`` characters joined by `` [...] `` when longer than ``limit``."""
    if len(text) <= limit:
        return text
    return text[: limit // 2] + " [...] " + text[-(limit // 2) :]


def eval_record(problem: dict, output, rewards: list[float], version: int) -> dict:
    """One problem's evaluation result (see ``actors.rollout.RolloutWorker.evaluate``).

    Returns:
        ``prompt_id``, ``answer``, ``meta``, ``policy_version``, ``rewards`` (n floats), ``num_correct``
        (rewards > 0.5), ``response_tokens`` (n ints), ``finish_reasons`` (n strings) and ``responses``
        (n texts, cut by :func:`clip_text`).
    """
    return {
        "prompt_id": problem["prompt_id"],
        "answer": problem["answer"],
        "meta": dict(problem.get("meta", {})),
        "policy_version": version,
        "rewards": list(rewards),
        "num_correct": int(sum(r > 0.5 for r in rewards)),
        "response_tokens": [len(c.token_ids) for c in output.outputs],
        "finish_reasons": [str(c.finish_reason) for c in output.outputs],
        "responses": [clip_text(c.text) for c in output.outputs],
    }


def eval_max_tokens(problems: list[dict], n: int, temperature: float, max_new_tokens: int, context: int) -> list[int]:
    """Per problem, the response limit that fits the engine's context after its prompt.

    Args:
        problems: prompt dicts with ``prompt_id`` and ``prompt_ids``.
        n: samples per problem; must be 1 when ``temperature`` is 0 (greedy).
        temperature: sampling temperature, 0 for greedy.
        max_new_tokens: the requested limit.
        context: the engine's ``max_model_len``.

    Raises:
        ValueError: greedy with ``n`` > 1, or a prompt that leaves no room for one token.
    """
    if temperature == 0 and n != 1:
        raise ValueError(f"greedy evaluation (temperature 0) samples once per problem, got n={n}")
    limits = []
    for p in problems:
        room = context - len(p["prompt_ids"])
        if room < 1:
            raise ValueError(f"prompt {p['prompt_id']} ({len(p['prompt_ids'])} tokens) fills the context")
        limits.append(min(max_new_tokens, room))
    return limits


def eval_batch(share: dict[str, dict], context: int) -> tuple[list[dict], list, dict[str, tuple[int, int]]]:
    """Every benchmark of an evaluation share as one engine batch.

    Args:
        share: ``{name: {"prompts", "n", "temperature", "max_new_tokens", ...}}``.
        context: the engine's context length in tokens.

    Returns:
        (problems of all benchmarks in order, one ``SamplingParams`` per problem, ``{name: (start, stop)}`` of
        each benchmark's problems).
    """
    problems, params, spans = [], [], {}
    for name, b in share.items():
        limits = eval_max_tokens(b["prompts"], b["n"], b["temperature"], b["max_new_tokens"], context)
        params += [sampling_params(b["n"], b["temperature"], m, logprobs=False) for m in limits]
        spans[name] = (len(problems), len(problems) + len(b["prompts"]))
        problems += b["prompts"]
    return problems, params, spans
