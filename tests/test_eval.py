"""Evaluation: pass@k by hand, summaries, the benchmark registry, answer checking on real references, the CLI.

The unit tests need no Ray; the one ``slow`` test runs ``python -m launch.eval`` end to end (local Ray,
the real vLLM engine, the tiny model) on a MATH500 slice.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from mugrpo_async.config import EvalConfig, load_config
from mugrpo_async.evaluation.benchmarks import (
    BENCHMARKS,
    benchmark_path,
    eval_plan,
    format_table,
    get_benchmark,
    load_benchmark,
    pass_at_k,
    summarize,
)
from mugrpo_async.rewards.boxed_math import boxed_reward, score_batch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"real data sets not found at {DATA}")


# ---- pass@k -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (16, 4, 4, 1 - 495 / 1820),  # 1 - C(12,4)/C(16,4)
        (4, 2, 3, 1.0),  # only 2 wrong: any 3 contain a correct one
        (3, 0, 2, 0.0),
        (3, 3, 1, 1.0),
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_enumeration_of_subsets():
    # The estimator is the fraction of k-subsets of the n samples holding at least one correct sample.
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_summarize_by_hand():
    records = [
        {"rewards": [1.0, 0.0, 0.0, 0.0], "response_tokens": [3, 5, 7, 9]},
        {"rewards": [1.0, 1.0, 0.0, 0.0], "response_tokens": [1, 1, 1, 1]},
    ]
    s = summarize("math500", records, ks=[1, 2, 8], dropped=3)
    assert (s["benchmark"], s["problems"], s["dropped"], s["n"]) == ("math500", 2, 3, 4)
    assert s["pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert s["pass@k"] == pytest.approx({1: 0.375, 2: (0.5 + 5 / 6) / 2})  # k=8 > n left out
    assert s["mean_response_tokens"] == pytest.approx(28 / 8)
    empty = summarize("aime24", [], ks=[1], dropped=30)
    assert (empty["problems"], empty["pass@1"], empty["pass@k"], empty["dropped"]) == (0, None, {}, 30)
    table = format_table([s, empty])
    assert "math500" in table and "0.3750" in table and "@2=0.667" in table and "aime24" in table


# ---- registry and plans -----------------------------------------------------------------------------------


def test_registry_matches_the_config_names():
    (names,) = typing.get_args(EvalConfig.model_fields["benchmarks"].annotation)
    assert set(typing.get_args(names)) == set(BENCHMARKS)
    with pytest.raises(KeyError, match="valid: heldout, math500, aime24"):
        get_benchmark("math5000")


def test_eval_plan_defaults_follow_the_paper():
    from mugrpo_async.config import ConfigError

    cfg = load_config(None, ["rollout.max_new_tokens=20"])
    assert {b: eval_plan(cfg, b).n for b in BENCHMARKS} == {
        "heldout": 4, "math500": 4, "aime24": 16, "aime25": 16, "amc23": 4, "gsm8k": 1, "humaneval": 4}  # fmt: skip
    assert eval_plan(cfg, "aime24").max_new_tokens == 20 and eval_plan(cfg, "aime24").temperature == 1.0
    cfg = load_config(None, ["eval.n_samples=2", "eval.max_new_tokens=7"])
    assert (eval_plan(cfg, "aime24").n, eval_plan(cfg, "aime24").max_new_tokens) == (2, 7)
    for n in (0, 1):  # greedy: one sample per problem, whatever the benchmark's default
        assert eval_plan(load_config(None, [f"eval.n_samples={n}", "eval.temperature=0"]), "aime24").n == 1
    with pytest.raises(ConfigError, match="eval.n_samples"):
        load_config(None, ["eval.n_samples=8", "eval.temperature=0"])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        (["eval.benchmarks=[math5000]"], "eval.benchmarks"),
        (["eval.ks=[0, 4]"], "eval.ks"),
        (["eval.temperature=-1"], "eval.temperature"),
        (["eval.n_samples=-1"], "eval.n_samples"),
        (["eval.max_problems=-2"], "eval.max_problems"),
    ],
)
def test_eval_config_errors_name_the_key(override, key):
    from mugrpo_async.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert key in str(err.value)


@needs_data
def test_every_benchmark_file_loads_clean(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    cfg = load_config(None, [f"eval.data_dir={DATA}", "data.max_prompt_tokens=200", "eval.max_problems=12"])
    sizes = {"math500": 500, "aime24": 30, "aime25": 30, "amc23": 40, "gsm8k": 1319}
    for name, bench in BENCHMARKS.items():
        from mugrpo_async.data.loaders import load_rows

        if not bench.relpath:  # heldout (the training data's split), humaneval (a package's data): no file here
            continue

        rows, skipped = load_rows(benchmark_path(name, DATA), bench.format)
        assert (len(rows), skipped) == (sizes[name], 0)
        prompts, dropped = load_benchmark(name, cfg, tokenizer)
        assert len(prompts) + dropped == 12
        assert all(p["prompt_id"].startswith(f"{name}:") and len(p["prompt_ids"]) <= 200 for p in prompts)


# ---- answer checking on real references -------------------------------------------------------------------

# References copied from ../shared/data (MATH500 unique_id or AMC23 id), with right and wrong answers.
REAL_ANSWERS = [
    ("\\frac{14}{3}", ["\\frac{14}{3}", "14/3", "\\dfrac{14}{3}"], ["4.67", "\\frac{3}{14}"]),  # algebra/2584
    ("\\dfrac{17}{50}", ["\\dfrac{17}{50}", "\\frac{17}{50}", "0.34"], ["\\frac{17}{5}"]),  # prealgebra/1655
    ("3\\sqrt{13}", ["3\\sqrt{13}", "\\sqrt{117}"], ["3", "13"]),  # algebra/2036
    ("(3,4]", ["(3,4]", "(3, 4]"], ["(3,4)", "[3,4]"]),  # intermediate_algebra/558
    ("(-\\infty, 0]", ["(-\\infty, 0]", "(-\\infty,0]"], ["(-\\infty, 0)", "0"]),  # precalculus/695
    ("\\left( 3, \\frac{\\pi}{2} \\right)", ["(3, \\frac{\\pi}{2})", "\\left(3,\\frac{\\pi}{2}\\right)"],
     ["3", "(3, \\pi)"]),  # precalculus/807
    ("1,-2", ["1,-2", "-2, 1"], ["1", "-2"]),  # intermediate_algebra/1388
    ("6 - 5i", ["6 - 5i", "6-5i"], ["5", "6 + 5i"]),  # precalculus/990
    ("\\text{(C)}", ["\\text{(C)}", "(C)", "C"], ["\\text{(B)}", "B"]),  # precalculus/819
    ("\\text{Evelyn}", ["\\text{Evelyn}", "Evelyn"], ["\\text{Navin}"]),  # algebra/1349
    ("5.4 \\text{ cents}", ["5.4", "5.4 \\text{ cents}"], ["54"]),  # prealgebra/1044
    ("\\frac{270}7\\text{ degrees}", ["\\frac{270}{7}", "\\frac{270}{7}^\\circ"], ["270"]),  # prealgebra/1003
    ("27", ["27", "27.0"], ["28"]),  # AMC23 id 0: 27.0 in the file, "27" after loading
    ("27.0", ["27", "27.0"], ["2.7"]),  # the raw float form still checks
    ("-1", ["-1", "-1.0"], ["1"]),  # AMC23 id 15
    ("25", ["25", "025"], ["250"]),  # AIME24 "025" after loading
]  # fmt: skip


@pytest.mark.parametrize(("reference", "right", "wrong"), REAL_ANSWERS, ids=[r[0] for r in REAL_ANSWERS])
def test_boxed_reward_on_real_references(reference, right, wrong):
    for answer in right:
        assert boxed_reward(f"The answer is $\\boxed{{{answer}}}$.", reference) == 1.0, answer
    for answer in wrong:
        assert boxed_reward(f"The answer is $\\boxed{{{answer}}}$.", reference) == 0.0, answer


@needs_data
def test_every_math500_and_amc23_reference_verifies_against_itself():
    from mugrpo_async.data.loaders import load_rows

    rows = load_rows(DATA / "math500" / "test.jsonl", "math")[0] + load_rows(DATA / "amc23" / "test.jsonl", "amc")[0]
    rewards, failed = score_batch([f"so \\boxed{{{r.answer}}}" for r in rows], [r.answer for r in rows])
    assert failed == 0
    assert [r.answer for r, x in zip(rows, rewards) if x != 1.0] == []


# ---- the CLI ----------------------------------------------------------------------------------------------


def _main(argv: list[str]) -> int:
    from launch.eval import main

    return main(argv)


def test_cli_input_errors_exit_2_before_ray(tiny_model, tmp_path, capsys):
    assert _main(["--model", str(tmp_path), "--benchmarks", "math500"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert _main(["--model", str(tiny_model), "--benchmarks", "math500,gsm8k", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/math500/test.jsonl" in err and f"{tmp_path}/gsm8k/test.jsonl" in err
    assert _main(["--model", str(tiny_model), "--benchmarks", "math5"]) == 2
    assert "eval.benchmarks" in capsys.readouterr().err
    assert _main(["--model", str(tiny_model)]) == 2
    assert "no benchmarks" in capsys.readouterr().err
    args = ["--model", str(tiny_model), "--benchmarks", "amc23", "--max-prompt-tokens", "250", "--max-new-tokens", "32"]
    assert _main(args) == 2
    assert "exceeds the model's 256 positions" in capsys.readouterr().err
    bad = tmp_path / "bad" / "amc23"
    bad.mkdir(parents=True)
    (bad / "test.jsonl").write_text('{"problem": "p", "answer": 1.0}\n{"problem": "q", "answer": "x"}\n')
    assert _main(["--model", str(tiny_model), "--benchmarks", "amc23", "--data-dir", str(tmp_path / "bad")]) == 2
    assert "amc23/test.jsonl, line 2: unparsable answer" in capsys.readouterr().err


@pytest.mark.slow
@needs_data
def test_cli_evaluates_the_tiny_model_end_to_end(tiny_model, tmp_path):
    # A data folder with the real MATH500 and, as "amc23", level-1 problems of the synthetic task in
    # AMC's float-answer form: the tiny model solves those, so the reward path is seen scoring 1.0.
    from mugrpo_async.data.task import generate_problems, prompt_text

    data_dir = tmp_path / "data"
    (data_dir / "amc23").mkdir(parents=True)
    (data_dir / "math500").symlink_to(DATA / "math500")
    arith = generate_problems(8, seed=1, levels=[1])
    rows = [{"problem": prompt_text(p), "answer": float(p.answer)} for p in arith]
    (data_dir / "amc23" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "launch.eval", "--model", str(tiny_model), "--benchmarks", "math500,amc23",
           "--data-dir", str(data_dir), "--n", "2", "--max-problems", "12", "--max-new-tokens", "24",
           "--max-prompt-tokens", "200", "--template", "none", "--out", str(out), "eval.ks=[1,2]"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())["benchmarks"]
    rows = [line.split() for line in proc.stdout.splitlines()]
    printed = {row[0]: row[1:4] for row in rows if row[:1] in (["math500"], ["amc23"])}  # the results table
    assert printed == {name: [str(s["problems"]), str(s["n"]), f"{s['pass@1']:.4f}"] for name, s in result.items()}

    math = result["math500"]
    assert math["problems"] + math["dropped"] == 12 and math["problems"] >= 1 and math["n"] == 2
    for rec in math["records"]:
        assert len(rec["rewards"]) == len(rec["response_tokens"]) == len(rec["responses"]) == 2
        assert all(1 <= t <= 24 for t in rec["response_tokens"]) and rec["meta"]["prompt_tokens"] <= 200

    amc = result["amc23"]
    assert (amc["problems"], amc["dropped"]) == (8, 0)
    assert [r["answer"] for r in amc["records"]] == [p.answer for p in arith]  # 7.0 -> "7"
    assert amc["pass@1"] > 0  # the tiny model answers a fair share of level-1 problems
    for s in (math, amc):
        counts = [(len(r["rewards"]), sum(r["rewards"])) for r in s["records"]]
        assert s["pass@1"] == pytest.approx(sum(c / n for n, c in counts) / len(counts))
        assert s["pass@k"]["2"] == pytest.approx(sum(pass_at_k(n, int(c), 2) for n, c in counts) / len(counts))
        assert s["pass@k"]["2"] >= s["pass@1"]
