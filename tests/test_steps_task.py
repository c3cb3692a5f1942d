"""Fast unit tests of the multi-step task: generator, texts, corrupted traces, the reward on them, its prompt pool
and config rules, and the warm start's training batches (no Ray, no vLLM)."""

from __future__ import annotations

import random
import re

import pytest

from mugrpo_async.config import ConfigError, load_config
from mugrpo_async.data.steps_task import (
    MAX_OPERAND,
    MAX_VALUE,
    STEP_LEVELS,
    corrupted_results,
    generate_steps_problems,
    prompt_text,
    target_text,
    true_results,
    worked_steps,
)
from mugrpo_async.rewards.boxed_math import boxed_reward
from tests.conftest import REPO

_QUESTION = re.compile(r"^(\d+)([+-])(\d) x(\d)$")
_STEP = re.compile(r"(\d+)\) (-?\d+)([+-])(\d)=(-?\d+)")


def _solve(question: str) -> tuple[int, list[int]]:
    """The level and the values after each step, read from the question independently of the generator."""
    start, op, operand, level = _QUESTION.match(question).groups()
    values, sign = [int(start)], 1 if op == "+" else -1
    for _ in range(int(level)):
        values.append(values[-1] + sign * int(operand))
    return int(level), values[1:]


def test_generator_is_deterministic_seeded_and_leaves_global_random_alone():
    random.seed(5)
    expected = random.random()
    random.seed(5)
    first = generate_steps_problems(40, seed=3)
    assert random.random() == expected
    assert first == generate_steps_problems(40, seed=3) and first != generate_steps_problems(40, seed=4)
    assert generate_steps_problems(10, seed=3) == first[:10]


def test_levels_cycle_ids_are_unique_and_answers_are_right():
    problems = generate_steps_problems(800, seed=1)
    assert [p.level for p in problems[:9]] == [1, 2, 3, 4, 5, 6, 7, 8, 1]
    assert [p.id for p in problems[:2]] == ["S1-1-0", "S2-1-1"] and len({p.id for p in problems}) == 800
    for p in problems:
        level, values = _solve(p.question)
        assert level == p.level and values == true_results(p) and p.answer == str(values[-1])
        assert all(0 <= v <= MAX_VALUE for v in [p.start, *values])
    assert {p.op for p in problems} == {"+", "-"} and {p.operand for p in problems} == set(range(1, MAX_OPERAND + 1))
    assert [p.level for p in generate_steps_problems(6, seed=1, levels=[8, 2, 2])] == [8, 2, 2, 8, 2, 2]


@pytest.mark.parametrize("levels", [[], [0], [9], [1, 9]])
def test_unknown_levels_are_refused(levels):
    with pytest.raises(ValueError, match="levels must be a non-empty subset"):
        generate_steps_problems(4, seed=0, levels=levels)


def test_texts_count_the_steps_down_and_box_the_last_result():
    (p,) = [q for q in generate_steps_problems(40, seed=2) if q.level == 4][:1]
    values = true_results(p)
    assert prompt_text(p) == f"Q: {p.start}{p.op}{p.operand} x4=? A:"
    expected_steps = "; ".join(
        f"{4 - i}) {prev}{p.op}{p.operand}={v}" for i, (prev, v) in enumerate(zip([p.start, *values], values))
    )
    assert target_text(p) == f" {expected_steps}. \\boxed{{{values[-1]}}}"
    for p in generate_steps_problems(80, seed=2):
        steps = _STEP.findall(target_text(p))
        assert [int(s[0]) for s in steps] == list(range(p.level, 0, -1))
        assert boxed_reward(target_text(p), p.answer) == 1.0


def test_a_wrong_step_is_carried_through_the_rest_and_scores_zero():
    p = generate_steps_problems(8, seed=6)[7]  # level 8
    sign, rng = (1 if p.op == "+" else -1), random.Random(0)
    for _ in range(200):
        wrong = corrupted_results(p, 0.2, rng)
        # the errors: steps whose written result is not the operation applied to the previous written one
        slips = [r - (prev + sign * p.operand) for prev, r in zip([p.start, *wrong], wrong)]
        assert all(s == 0 or 1 <= abs(s) <= 9 for s in slips) and min(wrong) >= 0
        if sum(s != 0 for s in slips) == 1 and slips[-1] == 0:
            break
    first = next(i for i, s in enumerate(slips) if s)
    truth = true_results(p)
    assert wrong[:first] == truth[:first]
    assert all(w == t + slips[first] for w, t in zip(wrong[first:], truth[first:]))  # a real suffix, shifted
    text = worked_steps(p, wrong)
    assert text.endswith(f"\\boxed{{{wrong[-1]}}}") and boxed_reward(text, p.answer) == 0.0
    assert corrupted_results(p, 0.0, rng) == truth
    rates = [corrupted_results(q, 0.1, rng) != true_results(q) for q in generate_steps_problems(2000, seed=3)]
    assert 0.3 < sum(rates) / len(rates) < 0.45  # 1 - 0.9 ** 4.5 = 0.38 on average over levels 1-8


def test_reward_scores_cut_and_malformed_responses_zero():
    p = generate_steps_problems(8, seed=4)[5]
    full = target_text(p)
    assert boxed_reward(full[: full.index("\\boxed") + 8], p.answer) == 0.0  # cut inside the box
    assert boxed_reward(full[: full.index(".")], p.answer) == 0.0  # steps, no box
    assert boxed_reward(full + f" \\boxed{{{int(p.answer) + 1}}}", p.answer) == 0.0  # the last box counts


def _cfg(*overrides: str):
    return load_config(REPO / "configs" / "tiny-cpu-reasoning.yaml", list(overrides))


def test_config_takes_the_task_levels_and_refuses_others():
    assert _cfg().data.source == "synthetic_steps" and _cfg().data.levels == list(STEP_LEVELS)
    with pytest.raises(ConfigError, match=r"data.levels: the multi-step task has levels \[1, 2, 3, 4, 5, 6, 7, 8\]"):
        _cfg("data.levels=[1, 9]")
    arithmetic = r"data.levels: the synthetic task has levels \[1, 2, 3, 4\], got \[5, 6, 7, 8\]"
    with pytest.raises(ConfigError, match=arithmetic):
        _cfg("data.source=synthetic")
    with pytest.raises(ConfigError, match="data.template: `plain` needs data.source `file`"):
        _cfg("data.template=plain")


@pytest.fixture(scope="module")
def tokenizer():
    from mugrpo_async.models.tiny import build_tokenizer

    problems = generate_steps_problems(50, seed=0)
    return build_tokenizer([prompt_text(p) for p in problems] + [target_text(p) for p in problems])


def test_prompt_pool_and_heldout_draw(tokenizer):
    from mugrpo_async.data.pool import load_prompts

    cfg = _cfg("data.num_problems=40", "eval.num_problems=16")
    prompts, dropped = load_prompts(cfg, tokenizer)
    problems = generate_steps_problems(40, seed=10_000, levels=STEP_LEVELS)
    assert dropped == 0 and [p["prompt_id"] for p in prompts] == [p.id for p in problems]
    for prompt, problem in zip(prompts, problems):
        assert tokenizer.decode(prompt["prompt_ids"]) == prompt_text(problem)
        assert prompt["answer"] == problem.answer and prompt["meta"]["level"] == problem.level
    heldout, _ = load_prompts(cfg, tokenizer, split="heldout")
    assert len(heldout) == 16 and not {p["prompt_id"] for p in heldout} & {p["prompt_id"] for p in prompts}
    assert load_prompts(_cfg("data.num_problems=40", "data.max_prompt_tokens=14"), tokenizer)[1] > 0


def test_a_disjoint_pool_leaves_out_every_held_out_prompt_and_keeps_its_size(tokenizer):
    from mugrpo_async.data.pool import load_prompts

    def texts(prompts):
        return [tokenizer.decode(p["prompt_ids"]) for p in prompts]

    base = ["data.num_problems=2000", "eval.num_problems=512", "data.levels=[1]"]  # level 1: 970 distinct problems
    shared, _ = load_prompts(_cfg(*base), tokenizer)
    held = set(texts(load_prompts(_cfg(*base), tokenizer, split="heldout")[0]))
    assert held & set(texts(shared))  # without the option the pool repeats held-out problems
    pool, _ = load_prompts(_cfg(*base, "data.heldout_disjoint=true"), tokenizer)
    assert len(pool) == 2000 and not held & set(texts(pool))
    kept = [p["prompt_id"] for p in shared if tokenizer.decode(p["prompt_ids"]) not in held]
    assert [p["prompt_id"] for p in pool][: len(kept)] == kept  # the same stream, held-out prompts skipped
    with pytest.raises(ValueError, match="held-out prompts cover nearly every problem"):
        load_prompts(_cfg("data.num_problems=100", "eval.num_problems=4000", "data.levels=[1]",
                          "data.heldout_disjoint=true"), tokenizer)  # fmt: skip
    with pytest.raises(ConfigError, match="data.heldout_disjoint applies to the synthetic sources"):
        _cfg("data.source=file", "data.path=x.jsonl", "data.heldout_disjoint=true")


def test_training_batch_masks_the_prompt_and_ends_with_eos(tokenizer):
    from mugrpo_async.models.tiny_steps import training_batch

    problems = generate_steps_problems(3, seed=0, levels=[1, 8, 2])
    input_ids, labels = training_batch(tokenizer, problems, 0.0, random.Random(0))  # (3, T) each
    for row, p in enumerate(problems):
        n_prompt = len(tokenizer(prompt_text(p), add_special_tokens=False)["input_ids"])
        kept = labels[row][labels[row] != -100].tolist()
        assert (labels[row, :n_prompt] == -100).all()
        assert kept[-1] == tokenizer.eos_token_id and tokenizer.decode(kept[:-1]) == target_text(p)
        assert input_ids[row, n_prompt : n_prompt + len(kept)].tolist() == kept


def test_length_report_percentiles_and_table():
    import numpy as np

    from launch.lengths import format_table, percentile

    values = [17, 20, 95, 128, 40, 33, 128, 64, 21]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    rows = [(1, 17, 1.0), (1, 21, 0.0), (8, 128, 0.0), (8, 100, 1.0)]
    lines = format_table(rows, limit=128).splitlines()
    assert lines[0].split() == ["level", "n", "p10", "p50", "p90", "p99", "max", "at", "cap", "accuracy"]
    assert lines[1].split() == ["1", "2", "17", "19", "21", "21", "21", "0.0%", "0.500"]
    assert lines[2].split() == ["8", "2", "103", "114", "125", "128", "128", "50.0%", "0.500"]
    assert lines[3].split()[0] == "all" and lines[3].split()[-2:] == ["25.0%", "0.500"]
