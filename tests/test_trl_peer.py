"""The TRL peer of benchmark 6 draws the project's prompt pool: its rows are the pool's texts and answers, in order.

The peer script runs in its own environment (``make bench-peer``) but builds its pool from the project's pure task,
prompt and reward modules; this checks, in the project's environment, that what it builds is what
``mugrpo_async.data.pool`` gives the project's run of each benchmarked config (same problems, same length filter).
"""

from __future__ import annotations

import argparse

import pytest

from bench import trl_peer, trl_peer_script
from bench.staging import FULL
from mugrpo_async.config import load_config
from mugrpo_async.data.pool import synthetic_prompts
from tests.conftest import REPO


@pytest.mark.parametrize("config", [trl_peer.TINY_CONFIG, "configs/tiny-cpu-reasoning.yaml"])
def test_peer_rows_are_the_project_pool(config, tiny_model, tiny_steps_model):
    from transformers import AutoTokenizer

    params = trl_peer.peer_params(config, FULL) | {"num_problems": 2000}  # a smaller pool than the run's: faster
    cfg = load_config(REPO / config, ["data.num_problems=2000"])
    tok = AutoTokenizer.from_pretrained(REPO / params["model"])
    args = argparse.Namespace(**{k: v for k, v in params.items() if k != "model"})
    rows = trl_peer_script.prompt_rows(args, tok)
    pool, dropped = synthetic_prompts(cfg, tok)
    assert params["task"] == cfg.data.source and len(rows) == len(pool) > 0
    assert [r["answer"] for r in rows] == [p["answer"] for p in pool]
    assert [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows] == [p["prompt_ids"] for p in pool]
