"""The input check both `launch.train` paths share: model folder, data file and benchmark files, each named by key.

Unit tier: no Ray. The CLI cases run `launch.train` in this process (a traceback would fail the test) and once
through a subprocess, each with and without ``--dry-run``: same one-line message, exit 2, nothing started.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from launch.train import main
from mugrpo_async.config import load_config
from mugrpo_async.inputs import SAMPLE_ROWS, InputError, check_inputs, input_problems
from tests.conftest import REPO

DATA = REPO.parent / "shared" / "data"


def _cfg(model, *overrides: str):
    return load_config(REPO / "configs" / "tiny-cpu.yaml", [f"model.path={model}", *overrides])


def _write_jsonl(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def truncated_model(tiny_model, tmp_path):
    folder = tmp_path / "truncated"
    shutil.copytree(tiny_model, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return folder


def test_tiny_default_and_real_files_pass(tiny_model):
    assert input_problems(_cfg(tiny_model)) == []
    if not DATA.is_dir():
        pytest.skip(f"no {DATA} here")
    cfg = _cfg(tiny_model, "data.source=file", f"data.path={DATA / 'gsm8k' / 'train.jsonl'}", "data.format=gsm8k",
               "data.template=plain", f"eval.data_dir={DATA}", "data.max_prompt_tokens=200",
               "eval.benchmarks=[math500, aime24, aime25, amc23, gsm8k]")  # fmt: skip
    assert input_problems(cfg) == []


def test_each_problem_names_its_key(tiny_model, truncated_model, tmp_path):
    assert input_problems(_cfg(truncated_model)) == [
        f"model.path: model folder {truncated_model}: model.safetensors is truncated "
        f"({(truncated_model / 'model.safetensors').stat().st_size} of "
        f"{(tiny_model / 'model.safetensors').stat().st_size} bytes)"
    ]
    assert input_problems(_cfg(tmp_path / "nothing")) == [f"model.path: no model folder at {tmp_path / 'nothing'}"]
    missing = tmp_path / "missing.jsonl"
    assert input_problems(_cfg(tiny_model, "data.source=file", f"data.path={missing}")) == [
        f"data.path: {missing}: no such data file"
    ]
    keyless = _write_jsonl(tmp_path / "rows.jsonl", [{"question": "1+1?", "answer": "2"}])
    assert input_problems(_cfg(tiny_model, "data.source=file", f"data.path={keyless}", "data.format=math")) == [
        f"data.path: {keyless}, line 1: missing field 'problem' (row has: question, answer)"
    ]
    custom = ["data.format=custom", "data.problem_key=prompt", "data.answer_key=answer"]
    assert input_problems(_cfg(tiny_model, "data.source=file", f"data.path={keyless}", *custom)) == [
        f"data.path: {keyless}, line 1: missing field 'prompt' (row has: question, answer)"
    ]


def test_context_template_and_benchmarks(tiny_model, tmp_path):
    # the tiny model has 256 positions; vLLM refuses a longer max_model_len
    assert input_problems(_cfg(tiny_model, "data.max_prompt_tokens=250")) == [
        "data.max_prompt_tokens + rollout.max_new_tokens: 250 + 16 = 266 tokens exceed the model's "
        f"max_position_embeddings 256 ({tiny_model}/config.json); vLLM refuses a longer context"
    ]
    rows = _write_jsonl(tmp_path / "rows.jsonl", [{"problem": "1+1?", "answer": "2"}])
    assert input_problems(_cfg(tiny_model, "data.source=file", f"data.path={rows}", "data.template=chat")) == [
        "data.template `chat`: the tokenizer has no chat_template; use `plain` or `auto`"
    ]
    bench = ["eval.benchmarks=[heldout, math500, gsm8k]", f"eval.data_dir={tmp_path / 'bench'}"]
    assert input_problems(_cfg(tiny_model, *bench)) == [
        f"eval.data_dir: no folder {tmp_path / 'bench'} here (it holds <benchmark>/test.jsonl of eval.benchmarks "
        "math500, gsm8k)"
    ]
    (tmp_path / "bench" / "math500").mkdir(parents=True)
    bad = _write_jsonl(tmp_path / "bench" / "math500" / "test.jsonl", [{"problem": "1+1?"}])
    assert input_problems(_cfg(tiny_model, *bench)) == [
        f"eval.data_dir: {tmp_path / 'bench'} has no gsm8k/test.jsonl (eval.benchmarks)",
        f"eval.data_dir: {bad}, line 1: missing field 'answer' (row has: problem) (benchmark math500)",
    ]


def test_only_leading_rows_are_read_unless_none_parses(tiny_model, tmp_path):
    good, bad = {"problem": "1+1?", "answer": "2"}, {"problem": "1+1?"}
    late = _write_jsonl(tmp_path / "late.jsonl", [good] * SAMPLE_ROWS + [bad])
    assert input_problems(_cfg(tiny_model, "data.source=file", f"data.path={late}")) == []  # left to the full load
    skip = ["data.source=file", "data.on_bad_row=skip"]
    first_bad = _write_jsonl(tmp_path / "first_bad.jsonl", [bad] * SAMPLE_ROWS + [good])
    assert input_problems(_cfg(tiny_model, *skip, f"data.path={first_bad}")) == []  # one valid row after them
    all_bad = _write_jsonl(tmp_path / "all_bad.jsonl", [bad] * (SAMPLE_ROWS + 1))
    assert input_problems(_cfg(tiny_model, *skip, f"data.path={all_bad}")) == [f"data.path: {all_bad}: no valid row"]


def test_check_inputs_joins_every_problem(tmp_path):
    cfg = _cfg(tmp_path / "m", "data.source=file", f"data.path={tmp_path / 'd.jsonl'}")
    with pytest.raises(InputError) as err:
        check_inputs(cfg)
    assert str(err.value) == (
        f"invalid inputs: model.path: no model folder at {tmp_path / 'm'}; "
        f"data.path: {tmp_path / 'd.jsonl'}: no such data file"
    )


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["--config", "configs/tiny-cpu.yaml", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("case", ["truncated", "missing_data", "keyless_data"])
def test_run_and_dry_run_refuse_bad_inputs_alike(case, capsys, tiny_model, truncated_model, tmp_path):
    keyless = _write_jsonl(tmp_path / "rows.jsonl", [{"question": "1+1?", "answer": "2"}])
    overrides, key = {
        "truncated": ([f"model.path={truncated_model}"], "model.path"),
        "missing_data": ([f"model.path={tiny_model}", "data.source=file", f"data.path={tmp_path / 'no.jsonl'}"],
                         "data.path"),
        "keyless_data": ([f"model.path={tiny_model}", "data.source=file", f"data.path={keyless}", "data.format=math"],
                         "data.path"),
    }[case]  # fmt: skip
    overrides.append(f"run.output_dir={tmp_path / 'run'}")
    rc_run, out_run, err_run = _cli(capsys, *overrides)
    rc_dry, out_dry, err_dry = _cli(capsys, "--dry-run", *overrides)
    assert rc_run == rc_dry == 2
    assert err_run == err_dry and err_run.startswith(f"error: invalid inputs: {key}: ") and err_run.count("\n") == 1
    assert out_run == "" and "total updates" in out_dry and "inputs            " not in out_dry
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_cli_subprocess_exits_2_before_ray(truncated_model, tmp_path):
    def cli(*extra: str) -> subprocess.CompletedProcess:
        code = ("import sys; from launch.train import main; rc = main(sys.argv[1:]); "
                "print(rc, sorted(m for m in ('ray', 'vllm', 'deepspeed') if m in sys.modules))")  # fmt: skip
        cmd = [sys.executable, "-c", code, "--config", "configs/tiny-cpu.yaml", f"model.path={truncated_model}",
               f"run.output_dir={tmp_path / 'run'}", *extra]  # fmt: skip
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)

    run, dry = cli(), cli("--dry-run")
    assert run.stdout.splitlines()[-1] == dry.stdout.splitlines()[-1] == "2 []"
    assert run.stderr == dry.stderr and run.stderr.startswith("error: invalid inputs: model.path: model folder ")
    assert "is truncated" in run.stderr and "Traceback" not in run.stderr and run.stderr.count("\n") == 1
