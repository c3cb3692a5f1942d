"""The dry run: every shipped config through the real CLI (plan and input check), and the memory numbers against
hand counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mugrpo_async.config import load_config
from mugrpo_async.reporting.plan import (
    KNOWN_ARCHITECTURES,
    Architecture,
    architecture_from_config,
    build_plan,
    format_plan,
    resolve_architecture,
    trainer_memory,
)
from tests.conftest import REPO

CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))
GPU_CONFIGS = [p for p in CONFIGS if p.parent.name == "gpu"]
CPU_CONFIGS = [p for p in CONFIGS if p.parent.name != "gpu"]
DATA = REPO.parent / "shared" / "data"
INPUTS_OK = "inputs            model folder, data file and benchmark files checked\n"
QWEN25_MATH_7B = 7_615_616_512  # published parameter count of Qwen2.5-7B / Qwen2.5-Math-7B


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launch.train", "--dry-run", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_configs_are_found():
    names = {p.relative_to(REPO / "configs").as_posix() for p in CONFIGS}
    assert {"tiny-cpu.yaml", "smollm2-135m-cpu.yaml", "gpu/qwen2.5-math-7b-mu-grpo.yaml"} <= names
    assert sum(n.startswith("gpu/") for n in names) == 1 + 6 * 4  # shared file + 6 models x (base + 3 variants)


def _config_id(path: Path) -> str:
    return path.relative_to(REPO / "configs").as_posix()


@pytest.mark.parametrize("path", CPU_CONFIGS, ids=_config_id)
def test_cpu_configs_pass_dry_run(path, tiny_model):
    done = _dry_run("--config", str(path.relative_to(REPO)))
    assert "nothing was started" in done.stdout and "total updates" in done.stdout
    cfg = load_config(path)
    if (REPO / cfg.model.path).is_dir():
        assert done.returncode == 0, done.stderr
        assert done.stdout.endswith(INPUTS_OK) and done.stderr == ""
    else:  # a folder `launch.prepare` builds (SmolLM2 from PyPI, the multi-step model) and this machine lacks
        assert done.returncode == 2
        expected = (f"error: invalid inputs: model.path: no model folder at {cfg.model.path} (build it "
                    f"with `python -m launch.prepare [--model NAME] --out {cfg.model.path}`)")  # fmt: skip
        if not DATA.is_dir() and cfg.data.source == "file":  # a checkout without ../shared/data beside it
            expected += (f"; data.path: {cfg.data.path}: no such data file; eval.data_dir: no folder "
                         f"{cfg.eval.data_dir} here (it holds <benchmark>/test.jsonl of eval.benchmarks "
                         "gsm8k)")  # fmt: skip
        assert done.stderr == expected + "\n"


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=_config_id)
def test_gpu_configs_print_the_plan_and_name_each_missing_input(path):
    """The GPU configs point at /models/... and data/ folders that do not exist here: plan, then exit 2."""
    done = _dry_run("--config", str(path.relative_to(REPO)))
    assert done.returncode == 2
    assert "nothing was started" in done.stdout and "total updates" in done.stdout and INPUTS_OK not in done.stdout
    cfg = load_config(path)
    code = cfg.eval.benchmarks == ["humaneval"]  # the code setup: HumanEval ships in a package, no folder needed
    assert done.stderr == (
        f"error: invalid inputs: model.path: no model folder at {cfg.model.path}; "
        f"data.path: {cfg.data.path}: no such data file"
        + ("" if code else "; eval.data_dir: no folder data here (it holds <benchmark>/test.jsonl of eval.benchmarks "
           "aime24, aime25, amc23, math500)") + "\n"
    )  # fmt: skip
    if path.name != "paper-common.yaml":
        # The paper's models: memory from config.json or the built-in table, never "not estimated".
        assert "trainer rank    weights" in done.stdout and "KV cache" in done.stdout
        assert cfg.model.dtype == "bfloat16" and cfg.trainer.lr == 1e-6 and cfg.rollout.group_size == 8
        assert (cfg.schedule.groups_per_update, cfg.schedule.total_updates) == (16 if code else 32, 4096)
        assert cfg.rollout.gpus_per_worker > 0 and cfg.trainer.gpus_per_rank > 0


@pytest.mark.skipif(not DATA.is_dir(), reason=f"real data sets not found at {DATA}")
def test_a_gpu_config_passes_with_inputs_that_exist(tiny_model):
    inputs = [f"model.path={tiny_model}", f"data.path={DATA / 'deepscaler' / 'train_math.json'}",
              f"eval.data_dir={DATA}"]  # fmt: skip
    config = ("--config", "configs/gpu/qwen2.5-math-7b-mu-grpo.yaml")
    too_long = _dry_run(*config, *inputs)  # 1024 + 3072 tokens: more than the tiny model's 256 positions
    assert too_long.returncode == 2 and too_long.stderr == (
        "error: invalid inputs: data.max_prompt_tokens + rollout.max_new_tokens: 1024 + 3072 = 4096 tokens exceed "
        f"the model's max_position_embeddings 256 ({tiny_model}/config.json); vLLM refuses a longer context\n"
    )
    done = _dry_run(*config, *inputs, "data.max_prompt_tokens=128", "rollout.max_new_tokens=128")
    assert done.returncode == 0, done.stderr
    assert f"sizes from {tiny_model / 'config.json'}" in done.stdout and done.stdout.endswith(INPUTS_OK)


def test_gpu_variants_are_the_paper_settings():
    for model in ("qwen2.5-math-7b", "deepseek-r1-distill-qwen-7b", "qwen3-1.7b-base", "qwen3-8b-base",
                  "llama-3.2-3b-instruct"):  # fmt: skip
        sync = load_config(REPO / f"configs/gpu/{model}-mu-grpo.yaml")
        grpo = load_config(REPO / f"configs/gpu/{model}-grpo-mu4.yaml")
        asyn = load_config(REPO / f"configs/gpu/{model}-async.yaml")
        assert (sync.algo.name, sync.schedule.mode, sync.schedule.mu, sync.schedule.num_stages) == (
            "mu_grpo",
            "sync",
            1024,
            4,
        )
        assert (grpo.algo.name, grpo.schedule.mu, grpo.algo.clip_low, grpo.algo.clip_high) == ("grpo", 4, 0.8, 1.2)
        assert (asyn.schedule.mode, asyn.schedule.mu, asyn.schedule.sync_every) == ("async", 1024, 4)
        assert len({sync.run.output_dir, grpo.run.output_dir, asyn.run.output_dir}) == 3
        assert sync.eval.benchmarks == ["aime24", "aime25", "amc23", "math500"] and sync.eval.every_updates == 200
        context = sync.data.max_prompt_tokens + sync.rollout.max_new_tokens
        assert context == (4096 if model == "qwen2.5-math-7b" else 1024 + 8192)


@pytest.mark.parametrize(
    "config, rc, absent",
    [
        # no model folder: nothing but the config is read
        ("configs/gpu/qwen3-8b-base-async.yaml", 2, ("ray", "torch", "vllm", "deepspeed", "transformers")),
        ("configs/tiny-cpu.yaml", 0, ("ray", "vllm", "deepspeed")),  # its tokenizer loads, nothing else
    ],
)
def test_dry_run_starts_nothing_heavy(config, rc, absent, tiny_model):
    code = (f"import sys; from launch.train import main; rc = main(['--config', '{config}', '--dry-run']); "
            f"print(rc, [m for m in {absent} if m in sys.modules])")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == f"{rc} []", done.stdout + done.stderr


def test_bad_config_still_exits_2_naming_the_key():
    done = _dry_run("--config", "configs/gpu/qwen3-8b-base-async.yaml", "trainer.lrr=1")
    assert done.returncode == 2 and "trainer.lrr" in done.stderr and "Traceback" not in done.stderr


def test_unknown_model_prints_plan_without_memory(tmp_path):
    done = _dry_run("--config", "configs/tiny-cpu.yaml", f"model.path={tmp_path / 'MyModel-3B'}")
    assert done.returncode == 2
    assert done.stderr == f"error: invalid inputs: model.path: no model folder at {tmp_path / 'MyModel-3B'}\n"
    assert "does not exist here" in done.stdout and "not estimated: unknown model" in done.stdout
    assert "trainer rank    weights" not in done.stdout and "total updates     128" in done.stdout


def test_zero_stage_rules_hand_checked():
    """7.6B parameters in bf16, 8 ranks: 2 bytes of weights and gradients, 12 of optimizer state per parameter."""
    P = QWEN25_MATH_7B
    assert trainer_memory(P, "bfloat16", 2, 8) == {
        "weights": 15_231_233_024,  # 2 P, replicated
        "gradients": 1_903_904_128,  # 2 P / 8
        "optimizer": 11_423_424_768,  # (4 m + 4 v + 4 master) P / 8
    }
    assert trainer_memory(P, "bfloat16", 0, 8) == {"weights": 2 * P, "gradients": 2 * P, "optimizer": 12 * P}
    assert trainer_memory(P, "bfloat16", 1, 8) == {"weights": 2 * P, "gradients": 2 * P, "optimizer": 12 * P // 8}
    assert trainer_memory(P, "bfloat16", 3, 8) == {"weights": 2 * P // 8, "gradients": 2 * P // 8,
                                                   "optimizer": 12 * P // 8}  # fmt: skip
    assert trainer_memory(10, "float32", 2, 4) == {"weights": 40, "gradients": 10, "optimizer": 20}  # no master


def test_plan_of_a_7b_under_zero2_on_8_ranks(tmp_path):
    folder = tmp_path / "Qwen2.5-Math-7B"  # not there: the built-in table by basename
    cfg = load_config(REPO / "configs/gpu/qwen2.5-math-7b-mu-grpo.yaml",
                      [f"model.path={folder}", "trainer.zero_stage=2", "trainer.num_ranks=8"])  # fmt: skip
    plan = build_plan(cfg)
    assert plan.num_params == QWEN25_MATH_7B and "built-in table" in plan.arch_source
    assert plan.trainer == trainer_memory(QWEN25_MATH_7B, "bfloat16", 2, 8)
    # KV cache: K and V x 28 layers x 4 KV heads x 128 dims x 2 bytes = 57344 bytes per token.
    assert plan.kv_per_token == 57_344
    assert plan.kv_cache == 57_344 * 256 * 4096  # B_mini x G sequences at 1024 + 3072 tokens
    text = format_plan(plan)
    assert "14.19 GiB" in text and "1.77 GiB" in text and "10.64 GiB" in text and "56.00 GiB" in text
    assert "does not exist here" in text and "8 x (4 CPU, 0.5 GPU)" in text  # colocated: half of each GPU


def test_config_json_wins_over_the_table(tmp_path):
    folder = tmp_path / "Qwen2.5-Math-7B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": True,
    }))  # fmt: skip
    arch, source, note = resolve_architecture(folder)
    assert source == f"sizes from {folder / 'config.json'}" and note == ""
    assert arch.head_dim == 32 and arch.num_parameters() == 2 * (4096 + 2 * 64 * 32 + 4096 + 3 * 64 * 128 + 128) + 6464


def test_context_over_the_model_limit_is_flagged():
    cfg = load_config(REPO / "configs/gpu/qwen2.5-math-7b-mu-grpo.yaml", ["rollout.max_new_tokens=4096"])
    assert "exceeds the model's max_position_embeddings 4096" in format_plan(build_plan(cfg))


def _hf_count(arch: Architecture, model_type: str) -> int:
    """Parameters of the transformers model with these sizes, built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, hidden_size=arch.hidden_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads, head_dim=arch.head_dim,
        intermediate_size=arch.intermediate_size, vocab_size=arch.vocab_size,
        tie_word_embeddings=arch.tied_embeddings,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(KNOWN_ARCHITECTURES))
def test_parameter_formula_matches_transformers(name):
    arch = KNOWN_ARCHITECTURES[name]
    model_type = "qwen2" if arch.qkv_bias else "qwen3" if arch.qk_norm else "llama"
    assert arch.num_parameters() == _hf_count(arch, model_type)
    config = {"model_type": model_type, "hidden_size": arch.hidden_size, "num_hidden_layers": arch.num_layers,
              "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
              "head_dim": arch.head_dim, "intermediate_size": arch.intermediate_size, "vocab_size": arch.vocab_size,
              "tie_word_embeddings": arch.tied_embeddings,
              "max_position_embeddings": arch.max_position_embeddings}  # fmt: skip
    assert architecture_from_config(config) == (arch, "")


def test_published_counts():
    assert KNOWN_ARCHITECTURES["Qwen2.5-Math-7B"].num_parameters() == QWEN25_MATH_7B
    smollm2 = Architecture(576, 30, 9, 3, 64, 1536, 49152, True)  # SmolLM2-135M, a tied Llama
    assert smollm2.num_parameters() == 134_515_008
    assert architecture_from_config({"model_type": "mixtral", "num_local_experts": 8})[0] is None
