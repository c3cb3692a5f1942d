"""Reward functions as plugins (mugrpo_async.rewards.plugins): loading by name from the working dir, the
start-up check of import and signature, the result check, timeouts and errors scored 0 and counted; and on
the real Ray, scorer actors running a plugin (the code reward) behind the memo."""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from mugrpo_async.config import load_config
from mugrpo_async.inputs import input_problems
from mugrpo_async.rewards import boxed_math, plugins
from mugrpo_async.rewards.plugins import RewardPluginError, check_result, context_key, function_problems, score_pair
from tests.conftest import REPO

PLUGIN = """
import time

def good(prompts, responses, references, metadata, bonus=0.0):
    return [float(r == ref) + bonus for r, ref in zip(responses, references)]

def slow(prompts, responses, references, metadata):
    time.sleep(30)

def raises(prompts, responses, references, metadata):
    raise RuntimeError("boom")

def short(prompts, responses, references, metadata):
    return []

def nan(prompts, responses, references, metadata):
    return [float("nan")] * len(responses)

def uses_meta(prompts, responses, references, metadata):
    return [float(m["want"] == r) for r, m in zip(responses, metadata)]

def two_args(responses, references):
    return [0.0]
"""


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A working dir holding ``myrewards.py`` (as a job's working dir would)."""
    name = f"myrewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.chdir(tmp_path)
    return name


def test_a_plugin_loads_from_the_working_dir_and_scores(plugin_dir):
    assert function_problems(f"{plugin_dir}:good", {"bonus": 0.5}) == []
    assert plugins.call(f"{plugin_dir}:good", {}, 5.0, ["p", "p"], ["1", "2"], ["1", "1"], [{}, {}]) == [1.0, 0.0]
    key = context_key({"answer": "1", "meta": {"want": "x"}, "prompt_text": "Q"}, with_context=True)
    assert json.loads(key) == {"reference": "1", "prompt": "Q", "metadata": {"want": "x"}}
    assert score_pair(f"{plugin_dir}:uses_meta", {}, 5.0, "x", key, True) == (1.0, False)


def test_start_up_check_names_import_attribute_and_signature_problems(plugin_dir):
    assert "cannot import 'no_such_mod'" in function_problems("no_such_mod:f", {})[0]
    assert "has no callable 'missing'" in function_problems(f"{plugin_dir}:missing", {})[0]
    (problem,) = function_problems(f"{plugin_dir}:two_args", {})
    assert problem.startswith("reward.function: ") and "two_args" in problem
    (problem,) = function_problems(f"{plugin_dir}:good", {"nope": 1})
    assert "nope" in problem


def test_raises_and_timeouts_score_zero_and_are_counted(plugin_dir):
    assert score_pair(f"{plugin_dir}:raises", {}, 5.0, "r", "1", False) == (0.0, True)
    assert score_pair(f"{plugin_dir}:slow", {}, 1.0, "r", "1", False) == (0.0, True)  # the alarm, 1 s


def test_wrong_shape_or_non_finite_result_is_an_error_naming_the_function(plugin_dir):
    with pytest.raises(RewardPluginError, match="short returned 0 rewards for 1 responses"):
        score_pair(f"{plugin_dir}:short", {}, 5.0, "r", "1", False)
    with pytest.raises(RewardPluginError, match="nan returned nan"):
        score_pair(f"{plugin_dir}:nan", {}, 5.0, "r", "1", False)
    with pytest.raises(RewardPluginError, match="not a list"):
        check_result("m:f", 1.0, 1)
    assert check_result("m:f", (1, 0.5), 2) == [1.0, 0.5]
    with pytest.raises(RewardPluginError):
        check_result("m:f", [math.inf], 1)


def test_the_math_plugin_agrees_with_score_batch():
    responses = ["\\boxed{1/2}", "\\boxed{3}", "no box", "\\boxed{\\frac{1}{2}}"]
    references = ["0.5", "4", "1", "0.5"]
    want, _ = boxed_math.score_batch(responses, references)
    got = [score_pair(plugins.DEFAULT_FUNCTION, {}, 5.0, r, ref, False) for r, ref in zip(responses, references)]
    assert [r for r, _ in got] == want == [1.0, 0.0, 0.0, 1.0] and not any(f for _, f in got)
    assert context_key({"answer": "7", "meta": {"level": 1}}, with_context=False) == "7"  # memo keys unchanged


def test_a_math_verify_failure_scores_zero_and_is_counted(monkeypatch):
    def broken(*args):
        raise RuntimeError("sympy broke")

    monkeypatch.setattr(boxed_math, "_verify_boxed", broken)
    assert score_pair(plugins.DEFAULT_FUNCTION, {}, 5.0, "\\boxed{2}", "2", False) == (0.0, True)


def test_config_and_input_check_report_the_reward_function():
    base = [f"model.path={REPO / 'no-model'}"]
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", base + ["reward.function=nope_mod:f"])
    assert any(p.startswith("reward.function: cannot import 'nope_mod'") for p in input_problems(cfg))
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", base)
    assert not [p for p in input_problems(cfg) if p.startswith("reward.")]


@pytest.mark.slow
def test_scorer_actors_run_the_code_plugin_and_stop_on_a_bad_function(ray_cluster, plugin_dir):
    from actors.reward import RewardMemo, RewardScorer
    from mugrpo_async.config import RewardConfig

    cfg = RewardConfig(function=plugins.CODE_FUNCTION, timeout_s=3.0, options={"partial": True})
    memo = RewardMemo(cfg, [RewardScorer.remote()])
    memo.warm_up()
    prompt = {"answer": "", "meta": {"tests": ["assert f(1) == 2", "assert f(2) == 4"]}, "prompt_text": "Q"}
    texts = [["def f(x):\n    return 2 * x", "def f(x):\n    return 2", "while True: pass", "def f(:"]]
    rewards, failures = memo.collect(texts, [memo.key(prompt)])
    assert rewards == [[1.0, 0.5, 0.0, 0.0]] and failures == 0  # programs that fail score 0, not a failure
    bad = RewardMemo(RewardConfig(function=f"{plugin_dir}:nan"), [RewardScorer.remote()])
    with pytest.raises(RewardPluginError, match="nan returned nan"):
        bad.collect([["x"]], [bad.key({"answer": "1"})])
