"""The multi-step task's model presets (``launch.prepare --model tiny-steps-1m``): the study's ~1M-parameter second
model has the design's sizes, built here with a two-step warm start (the real length is a build option)."""

from __future__ import annotations

import pytest

from launch import prepare
from mugrpo_async.checkpoints.model_folder import read_build_marker
from mugrpo_async.models.tiny import MARKER_FILE
from mugrpo_async.models.tiny_steps import STEPS_PRESETS, StepsSpec


def test_presets_are_the_launch_names_and_differ_in_their_cache_hash():
    assert tuple(STEPS_PRESETS) == prepare.STEPS_MODELS
    small, large = (StepsSpec(**STEPS_PRESETS[n]) for n in prepare.STEPS_MODELS)
    assert small == StepsSpec() and small.digest() != large.digest()
    assert large.model_kwargs() == {"hidden_size": 128, "num_layers": 4, "head_dim": 32, "num_kv_heads": 2,
                                    "intermediate_size": 512, "max_position_embeddings": 256}  # fmt: skip


def test_the_1m_model_builds_with_the_designs_sizes(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "m"
    assert prepare.main(["--model", "tiny-steps-1m", "--out", str(out), "--warm-start-steps", "2",
                         "--eval-per-level", "1"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert f"model folder: {out}" in printed and printed.count("sampled accuracy") == 8
    model = AutoModelForCausalLM.from_pretrained(out)
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.num_key_value_heads, c.head_dim) == (
        128, 4, 512, 2, 32)  # fmt: skip
    assert c.tie_word_embeddings and c.vocab_size == 258
    assert sum(p.numel() for p in model.parameters()) == 1_018_240  # docs/STUDY.md, "Second model"
    marker = read_build_marker(out, MARKER_FILE)  # the warm-start length is part of the cache key
    assert marker["spec"]["steps"] == 2
    assert marker["hash"] == StepsSpec(**STEPS_PRESETS["tiny-steps-1m"], steps=2).digest()


def test_warm_start_steps_is_refused_for_other_models():
    with pytest.raises(SystemExit):
        prepare.main(["--model", "tiny-arith", "--warm-start-steps", "5"])
