"""Verifiable reward: 1.0 when the last ``\\boxed{...}`` answer of a response verifies, else 0.0.

The answer is compared with math-verify (``math_verify.parse`` / ``math_verify.verify``), so
equivalent forms score alike: ``\\boxed{0.5}`` against ``"1/2"``, ``\\boxed{\\frac{1}{2}}`` against ``"0.5"``.

Threads and timeouts: math-verify implements its timeouts with ``signal.alarm``, which only works in
the main thread of a process; with a timeout set, ``parse``/``verify`` raise ``ValueError`` in any other
thread. These functions therefore use the timeout only when called from the main thread and pass
``None`` (no timeout, no signal handling) elsewhere, instead of raising. Run :func:`score_batch` in
Ray tasks, plain (single-threaded) Ray actors or process pools to keep the timeout; in thread pools
or threaded actors a pathological answer can then block its caller.
"""

from __future__ import annotations

import logging
import math
import re
import threading

from math_verify import parse, verify
from math_verify.errors import TimeoutException

logger = logging.getLogger(__name__)

_BOXED = "\\boxed"
_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only (str.isdigit would take other scripts' digits)


def _closing_brace(text: str, open_pos: int) -> int | None:
    """Returns the index of the brace closing the one at ``open_pos``, or None if unbalanced.

    Escaped braces (``\\{``, ``\\}``) are literal characters and do not count.
    """
    depth = 0
    pos = open_pos
    while pos < len(text):
        char = text[pos]
        if char == "\\":
            pos += 2  # skip the escaped character, e.g. \{ or \}
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return pos
        pos += 1
    return None


def last_boxed(text: str) -> str | None:
    """Returns the content of the last ``\\boxed{...}`` in ``text``.

    Nested braces are matched (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``) and whitespace between
    ``\\boxed`` and its brace is allowed. Only the last occurrence counts: if its brace never closes
    (e.g. a truncated response) the result is None even when an earlier box is complete.

    Args:
        text: A model response.

    Returns:
        The content with surrounding whitespace stripped, or None when there is no ``\\boxed{``
        or the last one is unbalanced.
    """
    search_end = len(text)
    while True:
        start = text.rfind(_BOXED, 0, search_end)
        if start < 0:
            return None
        brace = start + len(_BOXED)
        while brace < len(text) and text[brace].isspace():
            brace += 1
        if brace < len(text) and text[brace] == "{":
            break
        search_end = start  # e.g. "\boxedfoo": not a box, look further left
    close = _closing_brace(text, brace)
    if close is None:
        return None
    return text[brace + 1 : close].strip()


def _alarm_seconds(timeout_s: float | None) -> int | None:
    """Turns a timeout into math-verify's form: whole seconds for ``signal.alarm``, or None.

    None is returned outside the main thread (``signal.alarm`` is unavailable there) and for
    non-positive or missing timeouts. Fractions round up: ``signal.alarm`` takes whole seconds only.
    """
    if timeout_s is None or timeout_s <= 0:
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    return max(1, math.ceil(timeout_s))


def _verify_boxed(response: str, reference: str, timeout_s: float | None) -> float:
    """Scores one response; errors and timeouts propagate to the caller.

    Two plain integers (``-?[0-9]+``, e.g. GSM8K's and the synthetic task's answers) are compared as
    integers, which is what math-verify concludes for them (checked against it in the tests) at about a
    thousandth of its cost; every other answer goes through math-verify.
    """
    answer = last_boxed(response)
    if not answer:  # no box, or an empty one
        return 0.0
    ref = reference.strip()
    if _INTEGER.fullmatch(answer) and _INTEGER.fullmatch(ref):
        return 1.0 if int(answer) == int(ref) else 0.0
    seconds = _alarm_seconds(timeout_s)
    pred = parse(f"${_BOXED}{{{answer}}}$", parsing_timeout=seconds, raise_on_error=True)
    # The reference goes through the same boxed-LaTeX extraction as the prediction: plain parsing
    # keeps only part of a LaTeX answer (``3\\sqrt{13}`` -> 3, ``(-\\infty, 0]`` -> 0, ``1,-2`` -> 1).
    gold = parse(f"${_BOXED}{{{reference}}}$", parsing_timeout=seconds, raise_on_error=True)
    if not gold:  # fallback for a reference that does not fit in a box (e.g. unbalanced braces)
        gold = parse(reference, parsing_timeout=seconds, raise_on_error=True)
    if not pred or not gold:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=seconds, raise_on_error=True) else 0.0


def boxed_reward(response: str, reference: str, timeout_s: float | None = 5.0) -> float:
    """Returns 1.0 when the last boxed answer of ``response`` verifies against ``reference``, else 0.0.

    Never raises on odd inputs: a response without a box, garbage, a parse/verify error or a timeout
    gives 0.0 (errors and timeouts are logged as warnings).

    Args:
        response: The model's response text.
        reference: The reference answer, plain (``"68"``, ``"1/2"``) or LaTeX (``"\\frac{1}{2}"``).
        timeout_s: Seconds allowed for each math-verify parse/verify call, rounded up to whole
            seconds; None or <= 0 disables it. Ignored (treated as None) outside the main thread,
            see the module docstring.

    Returns:
        The reward, 1.0 or 0.0.
    """
    reward, _ = _score_one(response, reference, timeout_s)
    return reward


def _score_one(response: str, reference: str, timeout_s: float | None) -> tuple[float, bool]:
    """Returns ``(reward, failed)`` where ``failed`` flags a timeout or an exception."""
    try:
        return _verify_boxed(response, reference, timeout_s), False
    except TimeoutException:
        logger.warning("math-verify timed out (reference %r, response %.200r)", reference, response)
    except Exception:  # noqa: BLE001 - any math-verify/sympy failure scores 0.0 and is counted
        logger.warning("math-verify failed (reference %r, response %.200r)", reference, response, exc_info=True)
    return 0.0, True


def score_batch(responses: list[str], references: list[str], timeout_s: float | None = 5.0) -> tuple[list[float], int]:
    """Scores responses against their references with :func:`boxed_reward`.

    Meant to run in a process's main thread (a Ray task, a plain Ray actor, a process-pool worker)
    so that math-verify's ``signal.alarm`` timeouts apply; elsewhere it runs without timeouts.

    Args:
        responses: Model responses, length N.
        references: Reference answers, length N, aligned with ``responses``.
        timeout_s: Per-call timeout in seconds, as in :func:`boxed_reward`.

    Returns:
        ``(rewards, num_failed)``: N rewards in {0.0, 1.0}, and how many of the N scorings timed out
        or raised (each of those scored 0.0).

    Raises:
        ValueError: if the two lists differ in length.
    """
    if len(responses) != len(references):
        raise ValueError(f"got {len(responses)} responses but {len(references)} references")
    rewards: list[float] = []
    num_failed = 0
    for response, reference in zip(responses, references):
        reward, failed = _score_one(response, reference, timeout_s)
        rewards.append(reward)
        num_failed += int(failed)
    if num_failed:
        logger.warning("%d of %d reward computations timed out or failed", num_failed, len(responses))
    return rewards, num_failed


class ScoringFailed(Exception):
    """A math-verify error or timeout, already logged by :func:`_score_one`: the scorer scores it 0 and counts it."""


def reward(
    prompts: list[str], responses: list[str], references: list[str], metadata: list[dict], *, timeout_s: float = 5.0
) -> list[float]:
    """The default ``reward.function`` (``mugrpo_async.rewards.boxed_math:reward``): :func:`boxed_reward` as a
    plugin. A failed scoring raises :class:`ScoringFailed`, so that the scorer scores it 0 and counts it (as
    :func:`score_batch` counts it); prompts and metadata are not looked at."""
    rewards = []
    for response, reference in zip(responses, references):
        value, failed = _score_one(response, reference, timeout_s)
        if failed:
            raise ScoringFailed(f"math-verify failed on reference {reference!r}")
        rewards.append(value)
    return rewards


reward.uses_context = False  # a pure function of (response, reference): remembered across prompts
