"""Engine output -> Group / eval record, sampling and engine settings: pure logic, no Ray, no vLLM.

The engine's outputs are stand-ins shaped like vLLM's ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``
(only the attributes the library reads).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from mugrpo_async.config import Config
from mugrpo_async.rollout import groups
from mugrpo_async.rollout.engine import context_len, engine_args, engine_env


def _lp(value: float) -> SimpleNamespace:
    return SimpleNamespace(logprob=value, rank=1, decoded_token=None)


def _completion(tokens, logprobs, text="", finish="stop"):
    """A CompletionOutput stand-in; ``logprobs``: per position a dict token -> log-prob (the sampled one included)."""
    return SimpleNamespace(
        token_ids=list(tokens),
        logprobs=None if logprobs is None else [{t: _lp(v) for t, v in pos.items()} for pos in logprobs],
        text=text,
        finish_reason=finish,
    )


def _request(prompt_ids, completions):
    return SimpleNamespace(prompt_token_ids=list(prompt_ids), outputs=completions, request_id="0", finished=True)


def test_sampled_logprobs_takes_the_sampled_tokens_entry_at_each_position():
    # position 0: the sampled token 7 is not the top-1 (3), which vLLM also returns; position 1: only 9.
    c = _completion([7, 9], [{3: -0.1, 7: -2.5}, {9: -0.25}])
    assert groups.sampled_logprobs(c).tolist() == [-2.5, -0.25]


def test_sampled_logprobs_reads_vllms_flat_form():
    """``flat_logprobs`` (what sampling_kwargs asks for): one array read when every position holds only the sampled
    token, the per-position entries otherwise (a sampled token that is not the top-1 comes with it)."""
    from vllm.logprobs import FlatLogprobs

    assert groups.sampling_kwargs(8, 1.0, 16, logprobs=True)["flat_logprobs"] is True
    flat = FlatLogprobs()
    for tok, lp in [(7, -2.5), (9, -0.25), (4, -1.0)]:
        flat.append({tok: _lp(lp)})
    c = SimpleNamespace(token_ids=[7, 9, 4], logprobs=flat)
    assert groups.sampled_logprobs(c).tolist() == [-2.5, -0.25, -1.0]
    mixed = FlatLogprobs()
    mixed.append({3: _lp(-0.1), 7: _lp(-2.5)})
    mixed.append({9: _lp(-0.25)})
    assert groups.sampled_logprobs(SimpleNamespace(token_ids=[7, 9], logprobs=mixed)).tolist() == [-2.5, -0.25]


def test_sampled_logprobs_refuses_missing_logprobs():
    with pytest.raises(ValueError, match="log-prob"):
        groups.sampled_logprobs(_completion([1, 2], None))
    with pytest.raises(ValueError, match="log-prob"):
        groups.sampled_logprobs(_completion([1, 2], [{1: -1.0}]))


def test_make_group_fields_and_advantages():
    prompt = {"prompt_id": "p1", "prompt_ids": (5, 6), "answer": "3", "meta": {"level": 2}}
    out = _request(
        [5, 6],
        [
            _completion([1, 2, 3], [{1: -0.5}, {2: -1.5}, {3: -0.25}], "\\boxed{3}", "stop"),
            _completion([4], [{4: -3.0, 1: -0.1}], "x", "length"),
            _completion([1], [{1: -0.75}], "\\boxed{3}", "stop"),
            _completion([2, 2], [{2: -1.0}, {2: -2.0}], "y", "stop"),
        ],
    )
    g = groups.make_group(prompt, out, [1.0, 0.0, 1.0, 0.0], version=7, worker=3)
    assert (g.prompt_id, g.prompt_ids.tolist(), g.answer, g.policy_version) == ("p1", [5, 6], "3", 7)
    assert [r.tolist() for r in g.responses] == [[1, 2, 3], [4], [1], [2, 2]]
    assert [x.tolist() for x in g.behavior_logprobs] == [[-0.5, -1.5, -0.25], [-3.0], [-0.75], [-1.0, -2.0]]
    assert g.prompt_ids.dtype == "int32" and g.behavior_logprobs[0].dtype == "float32"
    assert g.finish_reasons == ["stop", "length", "stop", "stop"]
    # mean 0.5, unbiased std sqrt(1/3): A = +-0.5 / (0.57735 + 1e-6)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert g.advantages == pytest.approx([a, -a, a, -a], abs=1e-6)
    assert g.meta["level"] == 2 and g.meta["worker"] == 3 and len(g.meta["uid"]) == 16
    assert prompt["meta"] == {"level": 2}  # the prompt's own meta is not changed
    other = groups.make_group(prompt, out, [1.0, 1.0, 1.0, 1.0], version=7, worker=3)
    assert other.advantages == [0.0] * 4 and other.meta["uid"] != g.meta["uid"]


def test_clip_text_keeps_head_and_tail():
    assert groups.clip_text("abc", limit=4) == "abc"
    assert groups.clip_text("abcd", limit=4) == "abcd"
    assert groups.clip_text("abcdefghij", limit=4) == "ab [...] ij"
    long = "x" * 3000 + "\\boxed{5}"
    clipped = groups.clip_text(long)
    assert len(clipped) == groups.EVAL_TEXT_CHARS + len(" [...] ") and clipped.endswith("\\boxed{5}")


def test_eval_record_values():
    problem = {"prompt_id": "q", "prompt_ids": [1], "answer": "4", "meta": {"source": "gsm8k"}}
    out = _request([1], [_completion([1, 2], None, "a" * 5000, "length"), _completion([3], None, "\\boxed{4}")])
    rec = groups.eval_record(problem, out, [0.0, 1.0], version=12)
    assert rec == {
        "prompt_id": "q",
        "answer": "4",
        "meta": {"source": "gsm8k"},
        "policy_version": 12,
        "rewards": [0.0, 1.0],
        "num_correct": 1,
        "response_tokens": [2, 1],
        "finish_reasons": ["length", "stop"],
        "responses": ["a" * 1000 + " [...] " + "a" * 1000, "\\boxed{4}"],
    }


def test_eval_max_tokens_fits_each_prompt_in_the_context():
    problems = [{"prompt_id": "a", "prompt_ids": [0] * 10}, {"prompt_id": "b", "prompt_ids": [0] * 30}]
    assert groups.eval_max_tokens(problems, 4, 1.0, 16, context=40) == [16, 10]
    assert groups.eval_max_tokens(problems, 1, 0.0, 100, context=40) == [30, 10]
    with pytest.raises(ValueError, match="greedy"):
        groups.eval_max_tokens(problems, 2, 0.0, 16, context=40)
    with pytest.raises(ValueError, match="prompt b .30 tokens. fills the context"):
        groups.eval_max_tokens(problems, 1, 1.0, 16, context=30)


def test_sampling_kwargs_leave_only_the_temperature():
    kw = groups.sampling_kwargs(8, 0.7, 24, logprobs=True, seed=5)
    assert kw == {
        "n": 8,
        "temperature": 0.7,
        "max_tokens": 24,
        "logprobs": 0,
        "seed": 5,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "flat_logprobs": True,
    }
    assert groups.sampling_kwargs(1, 0.0, 4, logprobs=False)["logprobs"] is None


def test_engine_returns_processed_logprobs_and_is_quiet_below_debug():
    cfg = Config()
    args = engine_args(cfg, worker_index=2)
    assert args["logprobs_mode"] == "processed_logprobs" == groups.ENGINE_LOGPROBS_MODE
    assert args["max_model_len"] == context_len(cfg) == cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    assert args["seed"] == cfg.run.seed + 2000 and args["use_tqdm_on_load"] is False
    env = engine_env(cfg)
    assert env["VLLM_LOGGING_LEVEL"] == "ERROR" and env["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    debug = Config.model_validate({"logging": {"level": "DEBUG"}})
    assert engine_env(debug)["VLLM_LOGGING_LEVEL"] == "DEBUG" and "TORCH_CPP_LOG_LEVEL" not in engine_env(debug)
    assert engine_args(debug, 0)["use_tqdm_on_load"] is True
    assert "max_num_seqs" not in args and "OMP_NUM_THREADS" not in env  # the engine's and Ray's defaults
    tuned = Config.model_validate({"rollout": {"max_num_seqs": 1024, "engine_threads": 2}})
    assert engine_args(tuned, 0)["max_num_seqs"] == 1024 and engine_env(tuned)["OMP_NUM_THREADS"] == "2"
    assert "enable_chunked_prefill" not in args  # unseeded: the engine's chunked prefill
    seeded = Config.model_validate({"rollout": {"seeded_sampling": True, "max_new_tokens": 8000}})
    whole = engine_args(seeded, 0)  # a CPU generator cannot rewind a partial prefill's sample
    assert whole["enable_chunked_prefill"] is False and whole["max_num_batched_tokens"] == context_len(seeded)
    on_gpu = Config.model_validate({"rollout": {"seeded_sampling": True, "gpus_per_worker": 1}})
    assert "enable_chunked_prefill" not in engine_args(on_gpu, 0)
