"""Reward functions as plugins: ``reward.function: package.module:callable``, loaded by name.

A reward function takes a batch and returns one reward per response::

    def my_reward(prompts: list[str], responses: list[str], references: list[str], metadata: list[dict],
                  **options) -> list[float]: ...

``prompts`` are the rendered prompt texts where the data provides them (the code tasks do; else ""),
``references`` the data's answers, ``metadata`` each prompt's ``meta`` dict (e.g. a code problem's tests);
``options`` are ``reward.options``. A function that also takes a ``timeout_s`` keyword gets
``reward.timeout_s`` and bounds its own time (math-verify's alarms, the sandbox's wall limit); any other runs
under a ``signal.alarm`` of that many seconds. A function that does not look at prompts or metadata may say so
with ``fn.uses_context = False`` (the math default does): its rewards are then remembered per (response,
reference) pair, across prompts.

The module is imported from the working dir (a job's working dir) or an installed package. Run inside the
scorer actors (:mod:`actors.reward`), per response: a call that raises or times out scores 0 and is counted; a
result that is not one finite number per response is a :class:`RewardPluginError` naming the function, which
stops the run. :func:`function_problems` checks the import and the signature before anything starts.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import math
import numbers
import os
import signal
import sys
import threading
from collections.abc import Callable
from functools import cache

log = logging.getLogger(__name__)

DEFAULT_FUNCTION = "mugrpo_async.rewards.boxed_math:reward"
"""Math-verify on the last ``\\boxed{}`` (the paper's reward)."""

CODE_FUNCTION = "mugrpo_async.rewards.code:reward"
"""The sandboxed code reward."""

_ARGS = ("prompts", "responses", "references", "metadata")


class RewardPluginError(ValueError):
    """A reward function that cannot be loaded, called or trusted; the message names it."""


@cache
def load_function(spec: str, search_dir: str | None = None) -> Callable:
    """Import ``package.module:callable`` from ``search_dir`` (default: the working dir), else installed packages."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardPluginError(f"reward.function: {spec!r} is not of the form package.module:callable")
    folder = search_dir or os.getcwd()
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any import failure is reported with the name
        msg = f"reward.function: cannot import {module_name!r} ({type(err).__name__}: {err})"
        raise RewardPluginError(msg) from err
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise RewardPluginError(f"reward.function: {module_name!r} has no callable {attr!r}")
    return fn


def takes_timeout(fn: Callable) -> bool:
    """Whether ``fn`` accepts a ``timeout_s`` keyword (and then bounds its own time)."""
    params = inspect.signature(fn).parameters
    return "timeout_s" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def uses_context(fn: Callable) -> bool:
    """Whether ``fn``'s rewards depend on prompts and metadata (True unless it says otherwise)."""
    return bool(getattr(fn, "uses_context", True))


def function_problems(spec: str, options: dict) -> list[str]:
    """``"reward.function: why"`` problems of a spec with its options: the import and the signature."""
    try:
        fn = load_function(spec)
        signature = inspect.signature(fn)
    except (RewardPluginError, TypeError, ValueError) as err:
        return [str(err) if str(err).startswith("reward.") else f"reward.function: {spec}: {err}"]
    extra = {"timeout_s": 1.0} if takes_timeout(fn) else {}
    try:
        signature.bind([], [], [], [], **options, **extra)
    except TypeError as err:
        keys = ", ".join(sorted(options)) or "none"
        return [f"reward.function: {spec} cannot be called as f({', '.join(_ARGS)}, **reward.options) with "
                f"options {keys}: {err}"]  # fmt: skip
    return []


def call(
    spec: str, options: dict, timeout_s: float, prompts, responses, references, metadata, search_dir: str | None = None
) -> list[float]:
    """Run the function on a batch and check its result: one finite real number per response.

    Raises:
        RewardPluginError: for a result of the wrong shape or a non-finite value (naming the function).
        Exception: whatever the function raised, or TimeoutError past ``timeout_s`` (scored 0 by the caller).
    """
    fn = load_function(spec, search_dir)
    args = (list(prompts), list(responses), list(references), list(metadata))
    if takes_timeout(fn):
        out = fn(*args, **options, timeout_s=timeout_s)
    else:
        with _alarm(timeout_s):
            out = fn(*args, **options)
    return check_result(spec, out, len(responses))


def check_result(spec: str, out, n: int) -> list[float]:
    """``out`` as n floats, or :class:`RewardPluginError` naming ``spec``."""
    try:
        values = list(out)
    except TypeError:
        msg = f"reward.function {spec} returned {type(out).__name__}, not a list of {n} rewards"
        raise RewardPluginError(msg) from None
    if len(values) != n:
        raise RewardPluginError(f"reward.function {spec} returned {len(values)} rewards for {n} responses")
    bad = [v for v in values if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v)]
    if bad:
        raise RewardPluginError(f"reward.function {spec} returned {bad[0]!r}: rewards must be finite numbers")
    return [float(v) for v in values]


class _alarm:
    """``signal.alarm`` for ``seconds`` (rounded up) in the main thread; nothing elsewhere."""

    def __init__(self, seconds: float):
        self.seconds = max(1, math.ceil(seconds)) if threading.current_thread() is threading.main_thread() else 0

    def __enter__(self):
        if self.seconds:
            self.old = signal.signal(signal.SIGALRM, self._raise)
            signal.alarm(self.seconds)

    def __exit__(self, *exc):
        if self.seconds:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, self.old)

    def _raise(self, *args):
        raise TimeoutError(f"reward function past {self.seconds}s")


def context_key(prompt: dict, with_context: bool) -> str:
    """What the scorer needs of a prompt, as one string (the memo's key): the reference alone, or with
    ``with_context`` a JSON object of the reference, the prompt text and the metadata."""
    if not with_context:
        return prompt["answer"]
    item = {"reference": prompt["answer"], "prompt": prompt.get("prompt_text", ""), "metadata": prompt.get("meta", {})}
    return json.dumps(item, sort_keys=True)


def score_pair(spec: str, options: dict, timeout_s: float, response: str, key: str, with_context: bool,
               search_dir: str | None = None):  # fmt: skip
    """``(reward, failed)`` of one response: a raise or a timeout scores 0 and is flagged; a
    :class:`RewardPluginError` propagates."""
    if with_context:
        item = json.loads(key)
        prompt, reference, meta = item["prompt"], item["reference"], item["metadata"]
    else:
        prompt, reference, meta = "", key, {}
    try:
        (value,) = call(spec, options, timeout_s, [prompt], [response], [reference], [meta], search_dir)
        return value, False
    except RewardPluginError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the function scores 0 and is counted
        if type(err).__name__ == "ScoringFailed":  # the function logged why already (boxed_math)
            return 0.0, True
        kind = "timed out" if isinstance(err, TimeoutError) or "Timeout" in type(err).__name__ else "failed"
        log.warning("reward %s %s (reference %.200r, response %.200r): %s", spec, kind, reference, response, err)
        return 0.0, True
