"""Fast unit tests of the arithmetic task and the boxed reward (no Ray, no vLLM)."""

from __future__ import annotations

import re
import threading

import pytest

from mugrpo_async.data.task import LEVELS, Problem, generate_problems, prompt_text, target_text
from mugrpo_async.rewards import boxed_math as reward
from mugrpo_async.rewards.boxed_math import boxed_reward, last_boxed, score_batch

_EXPRESSION = re.compile(r"^(\d+)([+\-*])(\d+)(?:\+(\d+))?$")


def _evaluate(question: str) -> int:
    """Evaluates a task expression independently of the generator."""
    match = _EXPRESSION.match(question)
    assert match, question
    a, op, b, c = match.groups()
    value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    return value + int(c) if c is not None else value


def test_generator_is_deterministic_and_seed_dependent():
    assert generate_problems(50, seed=3) == generate_problems(50, seed=3)
    assert generate_problems(50, seed=3) != generate_problems(50, seed=4)
    assert generate_problems(20, seed=3) == generate_problems(50, seed=3)[:20]  # stable prefix


def test_generator_does_not_touch_global_random():
    import random

    random.seed(123)
    expected = random.random()
    random.seed(123)
    generate_problems(10, seed=0)
    assert random.random() == expected


def test_ids_unique_and_formatted():
    problems = generate_problems(400, seed=7)
    assert len({p.id for p in problems}) == 400
    for k, p in enumerate(problems):
        assert p.id == f"L{p.level}-7-{k}"


def test_levels_cycle_and_answers_are_correct():
    problems = generate_problems(400, seed=1)
    assert [p.level for p in problems[:8]] == [1, 2, 3, 4, 1, 2, 3, 4]
    for p in problems:
        assert p.answer == str(_evaluate(p.question))
        assert int(p.answer) >= 0


@pytest.mark.parametrize(
    ("level", "pattern"),
    [
        (1, r"^\d\+\d$"),
        (2, r"^(\d\*\d|\d\+\d\+\d)$"),
        (3, r"^\d\d[+-]\d$"),
        (4, r"^(\d\d[+-]\d\d|\d\d\*[2-9])$"),
    ],
)
def test_level_shapes(level, pattern):
    problems = generate_problems(200, seed=5, levels=[level])
    assert all(p.level == level for p in problems)
    assert all(re.match(pattern, p.question) for p in problems), [p.question for p in problems[:5]]


def test_generator_rejects_bad_arguments():
    with pytest.raises(ValueError):
        generate_problems(-1, seed=0)
    with pytest.raises(ValueError):
        generate_problems(3, seed=0, levels=[])
    with pytest.raises(ValueError):
        generate_problems(3, seed=0, levels=[5])
    assert generate_problems(0, seed=0) == []


def test_prompt_and_target_format():
    problem = Problem(id="L4-0-0", question="23+45", answer="68", level=4)
    assert prompt_text(problem) == "Q: 23+45=? A:"
    assert target_text(problem) == " \\boxed{68}"
    assert boxed_reward(target_text(problem), problem.answer) == 1.0
    for p in generate_problems(40, seed=2, levels=LEVELS):
        assert boxed_reward(target_text(p), p.answer) == 1.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{68}", "68"),
        ("so \\boxed{ 68 } done", "68"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{{a}{b{c}}}", "{a}{b{c}}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed {7}", "7"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{}", ""),
        ("no box here", None),
        ("", None),
        ("\\boxed{12", None),
        ("\\boxed{3} and \\boxed{4", None),  # the last box decides, even unclosed
        ("\\boxed 5", None),
        ("\\boxed{3} \\boxedx", "3"),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("response", "reference", "expected"),
    [
        (" \\boxed{68}", "68", 1.0),
        ("\\boxed{67}", "68", 0.0),
        ("68", "68", 0.0),  # no box, no reward
        ("\\boxed{0.5}", "1/2", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
        ("\\boxed{68.0}", "68", 1.0),
        ("\\boxed{12} wait \\boxed{68}", "68", 1.0),
        ("\\boxed{68} wait \\boxed{12}", "68", 0.0),
        ("\\boxed{}", "68", 0.0),
    ],
)
def test_boxed_reward(response, reference, expected):
    assert boxed_reward(response, reference) == expected


@pytest.mark.parametrize(
    "garbage",
    [
        "\\boxed{\\frac{",
        "\\boxed{}}}{{",
        "\\boxed{\\left(}",
        "\x00\\boxed{\u2603}",
        "\\boxed{" + "(" * 20 + "}",
        "\\boxed{\\\\\\\\}",
        "}}}}",
        "\\boxed{1/0}",
        "\\boxed{x^{y^{z}}}",
    ],
)
def test_garbage_gives_zero(garbage):
    assert boxed_reward(garbage, "68", timeout_s=1.0) == 0.0


def test_score_batch_counts_a_real_timeout(monkeypatch):
    # A parse that would run for 30 s (as deeply nested brackets can, on a slow machine): math-verify's
    # own signal.alarm timeout must stop it. The slow step is patched in so the test does not depend
    # on this machine's speed; the timeout mechanism is the real one.
    import time

    import math_verify.parser as mv_parser

    real_extract = mv_parser.extract_target_from_pred
    pathological = "\\boxed{" + "(" * 500 + "}"
    calls = {"started": 0, "finished": 0}

    def slow_extract(pred, *args, **kwargs):
        if "((((" in pred:
            calls["started"] += 1
            time.sleep(30)
            calls["finished"] += 1  # reached only if the timeout did not interrupt the sleep
        return real_extract(pred, *args, **kwargs)

    monkeypatch.setattr(mv_parser, "extract_target_from_pred", slow_extract)
    rewards, failed = score_batch([pathological, "\\boxed{2}"], ["1", "2"], timeout_s=0.5)
    assert calls["started"] >= 1 and calls["finished"] == 0  # interrupted every time, never waited out
    assert rewards == [0.0, 1.0]
    assert failed == 1


def test_reward_works_outside_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(boxed_reward("\\boxed{0.5}", "1/2", timeout_s=5)))
    thread.start()
    thread.join()
    assert results == [1.0]


def test_score_batch_scores_and_counts_failures(monkeypatch):
    rewards, failed = score_batch(["\\boxed{1}", "x", "\\boxed{3}"], ["1", "2", "4"], timeout_s=5.0)
    assert (rewards, failed) == ([1.0, 0.0, 0.0], 0)

    real_verify = reward.verify

    def flaky_verify(gold, pred, **kwargs):
        if str(pred[0]) == "13/2":
            raise reward.TimeoutException("too slow")
        if str(pred[0]) == "15/2":
            raise RuntimeError("sympy blew up")
        return real_verify(gold, pred, **kwargs)

    monkeypatch.setattr(reward, "verify", flaky_verify)  # fractions: plain integers never reach math-verify
    responses = ["\\boxed{13/2}", "\\boxed{15/2}", "\\boxed{17/2}", "none"]
    rewards, failed = score_batch(responses, ["13/2", "15/2", "17/2", "1"])
    assert rewards == [0.0, 0.0, 1.0, 0.0]
    assert failed == 2


def test_score_batch_rejects_misaligned_lists():
    with pytest.raises(ValueError):
        score_batch(["a"], [])


def test_integer_fast_path_agrees_with_math_verify():
    """Plain integers skip math-verify; on every such pair here math-verify itself gives the same reward."""
    import math_verify

    def by_math_verify(answer: str, ref: str) -> float:
        gold, pred = math_verify.parse(f"$\\boxed{{{ref}}}$"), math_verify.parse(f"$\\boxed{{{answer}}}$")
        return 1.0 if math_verify.verify(gold, pred) else 0.0

    values = ["0", "-0", "7", "07", "007", "-7", "-07", "12", "120", "21", "999999999999", "1000000000000"]
    calls = []
    real_parse = reward.parse
    reward.parse = lambda *a, **k: calls.append(a) or real_parse(*a, **k)
    try:
        for answer in values:
            for ref in values:
                want = by_math_verify(answer, ref)
                assert boxed_reward(f"so \\boxed{{{answer}}}", f" {ref} ") == want, (answer, ref)
    finally:
        reward.parse = real_parse
    assert not calls  # the fast path answered every one of them
    assert boxed_reward("\\boxed{7.0}", "7") == 1.0 and boxed_reward("\\boxed{+7}", "7") == 1.0  # math-verify's
