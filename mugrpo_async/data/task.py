"""Synthetic arithmetic task: the embedded default data set for CPU runs with a tiny model.

Every problem is an integer expression with a non-negative integer answer (subtraction always
has ``a >= b``). Levels, easiest first; each level's sampled accuracy for the tiny default model is
clearly below the previous one's (measured by ``launch/prepare.py``):

- level 1: ``a+b``, single-digit ``a, b`` (0-9); 100 distinct problems.
- level 2: ``a*b``, single-digit ``a, b``; or ``a+b+c``, single-digit ``a, b, c``; 1,100 problems.
- level 3: ``a+b`` or ``a-b``, two-digit ``a`` (10-99) and single-digit ``b`` (0-9); 1,800 problems.
- level 4: ``a+b`` or ``a-b`` with two-digit ``a, b`` (carries and borrows in both digits,
  about 12,000 problems), or ``a*b`` with two-digit ``a`` and ``b`` in 2-9 (mostly three-digit
  answers, 720 problems); each half of the time. Both kinds are hard for a small model and which
  of the two it learns first varies with training, so they share the top level.

Formats (short on purpose: the default model is tiny and tokenizes characters one by one)::

    prompt_text  -> "Q: 23+45=? A:"
    target_text  -> " \\boxed{68}"

The response is the answer alone inside ``\\boxed{...}``, the form that
:func:`mugrpo_async.rewards.boxed_math.boxed_reward` scores. Generation is deterministic: the same
``(n, seed, levels)`` always gives the same list, and problem ids ``f"L{level}-{seed}-{k}"`` (``k`` the
position in the list) are unique within a list and stable across calls.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

LEVELS: tuple[int, ...] = (1, 2, 3, 4)
"""All difficulty levels, easiest first."""

TASK_VERSION = "arith-v3"
"""Bump when the generator or the prompt/target format changes (invalidates cached tiny models)."""


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem.

    Attributes:
        id: Unique, stable identifier ``"L{level}-{seed}-{k}"``.
        question: The expression, e.g. ``"23+45"``.
        answer: The reference answer as a decimal integer string, e.g. ``"68"``.
        level: Difficulty level, one of :data:`LEVELS`.
    """

    id: str
    question: str
    answer: str
    level: int


def _add_or_subtract(a: int, b: int, rng: random.Random) -> tuple[str, int]:
    """Returns ``a+b`` or, as often, the larger minus the smaller (a non-negative answer)."""
    if rng.random() < 0.5:
        return f"{a}+{b}", a + b
    a, b = max(a, b), min(a, b)
    return f"{a}-{b}", a - b


def _make_expression(level: int, rng: random.Random) -> tuple[str, int]:
    """Draws one expression of a level and returns it with its value."""
    if level == 1:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"{a}+{b}", a + b
    if level == 2:
        if rng.random() < 0.5:
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            return f"{a}*{b}", a * b
        a, b, c = rng.randint(0, 9), rng.randint(0, 9), rng.randint(0, 9)
        return f"{a}+{b}+{c}", a + b + c
    if level == 3:
        a, b = rng.randint(10, 99), rng.randint(0, 9)
        return _add_or_subtract(a, b, rng)
    if level == 4:
        if rng.random() < 0.5:
            return _add_or_subtract(rng.randint(10, 99), rng.randint(10, 99), rng)
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        return f"{a}*{b}", a * b
    raise ValueError(f"unknown level {level!r}; valid levels are {LEVELS}")


def generate_problems(n: int, seed: int, levels: Sequence[int] = LEVELS) -> list[Problem]:
    """Generates ``n`` problems, cycling through ``levels`` in order.

    Problem ``k`` has level ``levels[k % len(levels)]``, so every level gets ``n // len(levels)``
    problems or one more. The draw depends only on ``(n, seed, levels)``: a private
    ``random.Random(seed)`` is used, the global RNG is untouched.

    Args:
        n: Number of problems (>= 0).
        seed: Seed of the generator; also part of each problem id.
        levels: Difficulty levels to draw from, each one of :data:`LEVELS`.

    Returns:
        The problems, ids ``f"L{level}-{seed}-{k}"`` for ``k`` in ``range(n)``.

    Raises:
        ValueError: if ``n`` is negative, ``levels`` is empty or holds an unknown level.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    levels = tuple(levels)
    if not levels or any(level not in LEVELS for level in levels):
        raise ValueError(f"levels must be a non-empty subset of {LEVELS}, got {levels}")
    rng = random.Random(seed)
    problems = []
    for k in range(n):
        level = levels[k % len(levels)]
        question, value = _make_expression(level, rng)
        problems.append(Problem(id=f"L{level}-{seed}-{k}", question=question, answer=str(value), level=level))
    return problems


def prompt_text(problem: Problem) -> str:
    """Returns the plain-text prompt, e.g. ``"Q: 23+45=? A:"``."""
    return f"Q: {problem.question}=? A:"


def target_text(problem: Problem) -> str:
    """Returns the supervised response, e.g. ``" \\boxed{68}"`` (leading space included)."""
    return f" \\boxed{{{problem.answer}}}"
