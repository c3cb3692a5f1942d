"""Synthetic multi-step task: responses write a worked step per operation before the ``\\boxed{}`` answer.

The reasoning-shaped counterpart of the arithmetic task (:mod:`mugrpo_async.data.task`), selected by
``data.source: synthetic_steps``. A problem is a start value and one operation (``+b`` or ``-b``, ``b`` in
1-5) applied ``level`` times, 1 to 8; every value along the way, answer included, is an integer in 0-99.
The response counts its steps down (the last one is numbered 1), writes each intermediate result, then
boxes the last one::

    prompt_text  -> "Q: 12+7 x4=? A:"
    target_text  -> " 4) 12+7=19; 3) 19+7=26; 2) 26+7=33; 1) 33+7=40. \\boxed{40}"

A step costs 11 or 12 tokens with the tiny model's byte tokenizer, so the reference response of level L
holds about ``12 L + 8`` tokens (20 at level 1, 103 at level 8). A sampled response runs longer when the
model miscounts its steps or loses the format, and a wrong step carries its wrong value through the
remaining steps: the suffix after the error is real work, not a single wrong token. The answer is scored
like the arithmetic task's, by :func:`mugrpo_async.rewards.boxed_math.boxed_reward` on the last box.

Each step repeats one operation on purpose: the tiny model reads its operation next to the previous step
and spends its small capacity on the carries, the counting and the stop (a chain of different operations
needs a look-up into the prompt per step that it does not learn within the warm start's budget).

Generation is deterministic: the same ``(n, seed, levels)`` always gives the same list; ids
``f"S{level}-{seed}-{k}"`` are unique within a list and stable across calls.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

STEP_LEVELS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
"""All levels (numbers of steps), easiest first."""

STEPS_TASK_VERSION = "steps-v1"
"""Bump when the generator or the prompt/target format changes (invalidates cached models)."""

MAX_VALUE = 99
"""Largest value of the start, every intermediate result and the answer (the smallest is 0)."""

MAX_OPERAND = 5
"""Operands are 1..MAX_OPERAND (larger ones leave the tiny model's warm start with too few correct carries)."""


@dataclass(frozen=True)
class StepsProblem:
    """One problem: ``start``, then ``op operand`` applied ``level`` times.

    Attributes:
        id: Unique, stable identifier ``"S{level}-{seed}-{k}"``.
        question: What the prompt shows, e.g. ``"12+7 x4"``.
        answer: The final value as a decimal string, e.g. ``"40"``.
        level: Number of steps, one of :data:`STEP_LEVELS`.
        start: The start value (12).
        op: ``"+"`` or ``"-"``.
        operand: 1-9.
    """

    id: str
    question: str
    answer: str
    level: int
    start: int
    op: str
    operand: int


def apply(value: int, op: str, operand: int) -> int:
    """One step: ``value op operand``."""
    return value + operand if op == "+" else value - operand


def make_problem(level: int, rng: random.Random, problem_id: str) -> StepsProblem:
    """Draws one problem of ``level`` steps whose values all stay within 0..MAX_VALUE."""
    if level not in STEP_LEVELS:
        raise ValueError(f"unknown level {level!r}; valid levels are {STEP_LEVELS}")
    op, operand = rng.choice("+-"), rng.randint(1, MAX_OPERAND)
    span = level * operand
    start = rng.randint(0, MAX_VALUE - span) if op == "+" else rng.randint(span, MAX_VALUE)
    answer = start + span if op == "+" else start - span
    return StepsProblem(problem_id, f"{start}{op}{operand} x{level}", str(answer), level, start, op, operand)


def generate_steps_problems(n: int, seed: int, levels: Sequence[int] = STEP_LEVELS) -> list[StepsProblem]:
    """Generates ``n`` problems, cycling through ``levels`` in order (a level listed twice gets twice the share).

    The draw depends only on ``(n, seed, levels)`` (a private ``random.Random(seed)``; the global one is untouched).

    Raises:
        ValueError: if ``n`` is negative, ``levels`` is empty or holds an unknown level.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    levels = tuple(levels)
    if not levels or any(level not in STEP_LEVELS for level in levels):
        raise ValueError(f"levels must be a non-empty subset of {STEP_LEVELS}, got {levels}")
    rng = random.Random(seed)
    return [make_problem(levels[k % len(levels)], rng, f"S{levels[k % len(levels)]}-{seed}-{k}") for k in range(n)]


def prompt_text(problem: StepsProblem) -> str:
    """The plain-text prompt, e.g. ``"Q: 12+7 x4=? A:"``."""
    return f"Q: {problem.question}=? A:"


def worked_steps(problem: StepsProblem, results: Sequence[int]) -> str:
    """The response whose step ``i`` writes ``results[i]`` (true values or not): each step is numbered with
    the steps left including itself (a countdown, so that the last step is the one numbered 1), starts from
    the previous written result, and the last written result is boxed."""
    steps, value = [], problem.start
    for i, result in enumerate(results):
        steps.append(f"{len(results) - i}) {value}{problem.op}{problem.operand}={result}")
        value = result
    return f" {'; '.join(steps)}. \\boxed{{{value}}}"


def true_results(problem: StepsProblem) -> list[int]:
    """The value after each step."""
    values = [problem.start]
    for _ in range(problem.level):
        values.append(apply(values[-1], problem.op, problem.operand))
    return values[1:]


def target_text(problem: StepsProblem) -> str:
    """The correct worked response, e.g. ``" 2) 12+7=19; 1) 19+7=26. \\boxed{26}"``."""
    return worked_steps(problem, true_results(problem))


def corrupted_results(problem: StepsProblem, error_rate: float, rng: random.Random) -> list[int]:
    """Step results where each step is wrong with probability ``error_rate`` (off by 1-9, never negative) and
    every later step applies the operation correctly to the written, possibly wrong, value: a wrong step
    carries through the rest of the response as it would in a real derivation."""
    results, value = [], problem.start
    for _ in range(problem.level):
        value = apply(value, problem.op, problem.operand)
        if rng.random() < error_rate:
            delta = rng.randint(1, 9)
            value = value + delta if value < delta or rng.random() < 0.5 else value - delta
        results.append(value)
    return results
