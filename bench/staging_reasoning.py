"""Benchmark 8, staging on the multi-step task: GRPO mu=4 against mu-GRPO (4 stages), twice, with the engines'
occupancy, the straggler tail and a 0.46B model's weight sync on the clock.

The pair of benchmark 1 on ``configs/tiny-cpu-reasoning.yaml`` (worked steps before the answer, responses from
about 20 tokens to the 128-token limit): the same 128 updates of B_mini = 16 groups of G = 8, GRPO in 32 stages
of 64 groups, mu-GRPO in 4 stages of 512. Both runs are made ``REPEATS`` times, alternately, so the table gives
each ratio per repeat (the spread). Per run, from its stage records: the engines' occupancy (running sequences
over ``max_num_seqs`` while a stage generated, mean over stages), the tail (seconds from the 90th-percentile
response's end to the last one's, summed over the generation calls) and its share of T_rollout.

Beside them, async mu-GRPO on the same task and updates (one worker keeping ``rollout.batch_groups`` groups in
its engine, a new group started as each finishes): its engine occupancy over the loop's wall time, against the
staged stages'. It runs twice: with ``max_num_seqs / G`` groups in flight, and with twice that. A group frees its
slots one response at a time but is replaced only when its last response ends, so at the first target the
engine runs partly empty while a group finishes; at the second, waiting requests fill the freed slots.

Sync cost of a real model size: the tiny model's weight sync costs milliseconds, a 0.46B model's seconds on this
machine. The benchmark measures one 0.46B publish + apply in the same invocation (benchmark 3's ``measure``: a
real ZeRO-2 rank and a real vLLM engine, object store and collective, the faster one) and charges it once per
stage of each run: T_run + stages x t_sync. The per-sync cost and the stage counts are measured; their sum is
arithmetic, since a 0.46B model cannot train 128 updates on this CPU in a benchmark's time.

    .venv/bin/python -m bench.run --only 8 [--smoke]
"""

from __future__ import annotations

import statistics

from bench.common import Row, Section, TrainRun, bench_command, md_table, ratio, train
from bench.staging import breakdown

CONFIG = "configs/tiny-cpu-reasoning.yaml"
FULL = {"updates": 128, "b_mini": 16, "grpo_mu": 4, "mu_grpo_mu": 32, "repeats": 2,
        "sync_model": "qwen2-0.46b", "sync_repeats": 3, "batch_groups": 32}  # fmt: skip
SMOKE = {"updates": 4, "b_mini": 4, "grpo_mu": 1, "mu_grpo_mu": 4, "repeats": 1,
         "sync_model": "tiny-140k", "sync_repeats": 1, "batch_groups": 4}  # fmt: skip


def staged_run(p: dict, repeat: int, algo: str) -> TrainRun:
    """One staged run on the multi-step task: ``algo`` ``grpo`` (mu = p's grpo_mu) or ``mu_grpo``; ``repeat`` makes
    each repeat a run of its own (benchmark 6 reuses repeat 0's mu-GRPO run)."""
    mu = p["grpo_mu"] if algo == "grpo" else p["mu_grpo_mu"]
    return train([f"schedule.total_updates={p['updates']}", f"schedule.groups_per_update={p['b_mini']}",
                  f"run.name=bench8-{repeat}", f"algo.name={algo}", f"schedule.mu={mu}"], config=CONFIG)  # fmt: skip


def pair(p: dict, repeat: int) -> tuple[TrainRun, TrainRun]:
    """(GRPO mu=4, mu-GRPO) on the multi-step task."""
    return staged_run(p, repeat, "grpo"), staged_run(p, repeat, "mu_grpo")


def async_run(p: dict, batch_groups: int) -> TrainRun:
    """Async mu-GRPO on the multi-step task, the same updates: one worker keeps ``batch_groups`` groups in its
    engine, a new one started as each finishes."""
    return train([f"schedule.total_updates={p['updates']}", f"schedule.groups_per_update={p['b_mini']}",
                  "schedule.mode=async", "schedule.mu=1024", "schedule.sync_every=4", "algo.name=mu_grpo",
                  f"rollout.batch_groups={batch_groups}", f"run.name=bench8-async-{batch_groups}"],
                 config=CONFIG)  # fmt: skip


def async_stats(run: TrainRun) -> dict:
    """The async run's engine occupancy (over the worker loop's wall time, and over its stepping time) and times."""
    workers = run.end.get("workers") or []
    busy = [w["engine_occupancy_busy"] for w in workers if "engine_occupancy_busy" in w]
    drain = [w["engine_occupancy_drain"] for w in workers if "engine_occupancy_drain" in w]
    return {"occupancy": run.end["engine_occupancy"], "occupancy_busy": statistics.fmean(busy) if busy else None,
            "occupancy_drain": statistics.fmean(drain) if drain else None,
            "T_run": run.t_run, "idle": run.end["trainer_idle_ratio"],
            "drains": sum(w.get("drains", 0) for w in workers),
            "t_drain_s": sum(w.get("t_drain_s", 0.0) for w in workers)}  # fmt: skip


def stats(run: TrainRun, t_sync: float) -> dict:
    """The figures of one run; ``t_sync``: the measured sync seconds of the larger model, charged per stage."""
    st = run.stages
    occ = [s["engine_occupancy"] for s in st if s.get("engine_occupancy") is not None]
    tail = sum(s.get("engine_tail_s", 0.0) for s in st)
    return {
        "stages": len(st),
        "T_total": run.end["T_total"],
        "T_run": run.t_run,
        "T_rollout": run.end["T_rollout"],
        "T_train": run.end["T_train"],
        "T_weight_sync": run.end["T_weight_sync"],
        "occupancy": statistics.fmean(occ) if occ else float("nan"),
        "tail_s": tail,
        "tail_share": tail / max(run.end["T_rollout"], 1e-9),
        "response_tokens": sum(s["response_tokens"] for s in st),
        "reward_last": run.end["reward_per_stage"][-1],
        "T_run_synced": run.t_run + len(st) * t_sync,
    }


def sync_cost(model: str, repeats: int) -> tuple[float, str]:
    """(seconds of the fastest measured publish + apply of ``model``, which backend) in this invocation (benchmark
    3's figure when it measured the same)."""
    from bench.weight_sync import measure_all

    results, errors = measure_all([model], repeats)
    if model not in results:
        raise RuntimeError(f"the weight sync of {model} was not measured: {errors.get(model)}")
    r = results[model]
    return min((r["full_s"], "object_store"), (r["collective_s"], "collective"))


def limit(pairs: list[tuple[dict, dict]]) -> str:
    """What bounds the ratios, from the first repeat's figures."""
    a, b = pairs[0]
    tok_a, tok_b = a["response_tokens"] / a["T_rollout"], b["response_tokens"] / b["T_rollout"]
    c = (a["T_run"] - b["T_run"]) / max(a["stages"] - b["stages"], 1)
    return (
        f"staging here buys engine occupancy ({a['occupancy']:.2f} -> {b['occupancy']:.2f}: rollout tokens/s "
        f"{tok_b / tok_a:.2f}x) and c = {c:.2f} s per stage (T_run = W + stages x c); the straggler tail is "
        f"{a['tail_share']:.0%} of GRPO's T_rollout (responses capped at 128 tokens, lengths set by the level) and "
        f"the tiny model's weight sync {a['T_weight_sync'] / a['stages'] * 1e3:.0f} ms a stage: the costs that "
        "large stages amortise are small on this workload until a real model's sync is charged (the third row)"
    )


def _rows(pairs: list[tuple[dict, dict]], cmd: str, model: str, t_sync: float) -> list[Row]:
    roll, run_, synced = ([ratio(a[k], b[k]) for a, b in pairs] for k in ("T_rollout", "T_run", "T_run_synced"))

    def shown(xs: list[float]) -> str:
        return " / ".join(f"{x:.2f}x" for x in xs)

    why = limit(pairs)
    return [
        Row("T_rollout ratio GRPO / mu-GRPO, multi-step task (per repeat)", ">= 1.8x", shown(roll), min(roll) >= 1.8,
            cmd, why),
        Row("T_total ratio GRPO / mu-GRPO without start-up, multi-step task (per repeat)", ">= 1.5x", shown(run_),
            min(run_) >= 1.5, cmd, why),
        Row(f"T_total ratio with a {model} weight sync per stage ({t_sync:.2f} s each, measured)", ">= 1.5x",
            shown(synced), min(synced) >= 1.5, cmd, why),
    ]  # fmt: skip


def _table(pairs: list[tuple[dict, dict]]) -> str:
    keys = [("stages", "{:.0f}"), ("T_run", "{:.1f}"), ("T_rollout", "{:.1f}"), ("T_train", "{:.1f}"),
            ("T_weight_sync", "{:.2f}"), ("T_run_synced", "{:.1f}"), ("occupancy", "{:.3f}"), ("tail_s", "{:.1f}"),
            ("tail_share", "{:.3f}"), ("response_tokens", "{:.0f}"), ("reward_last", "{:.3f}")]  # fmt: skip
    head = [""] + [f"{side} #{i + 1}" for i in range(len(pairs)) for side in ("GRPO mu=4", "mu-GRPO")]
    rows = [[k] + [fmt.format(s[k]) for a, b in pairs for s in (a, b)] for k, fmt in keys]
    return md_table(head, rows)


def run(smoke: bool) -> Section:
    p = SMOKE if smoke else FULL
    runs = [pair(p, i) for i in range(p["repeats"])]
    a_run, a2_run = async_run(p, p["batch_groups"]), async_run(p, 2 * p["batch_groups"])
    asy, asy2 = async_stats(a_run), async_stats(a2_run)
    t_sync, backend = sync_cost(p["sync_model"], p["sync_repeats"])
    pairs = [(stats(a, t_sync), stats(b, t_sync)) for a, b in runs]
    cmd = bench_command(8, smoke)
    sec = Section(8, "Staging on the multi-step task: GRPO mu=4 vs mu-GRPO, engine occupancy, tail, sync cost")
    sec.rows = _rows(pairs, cmd, p["sync_model"], t_sync)
    staged_occ = statistics.fmean(b["occupancy"] for _, b in pairs)
    sec.rows.append(Row("engine occupancy, async mu-GRPO (continuous batching) / staged mu-GRPO stages", "(context)",
                        f"{asy['occupancy']:.3f} / {staged_occ:.3f} (async over its stepping time: "
                        f"{asy['occupancy_busy'] or float('nan'):.3f})", None, cmd))  # fmt: skip
    sec.rows.append(Row(f"async mu-GRPO, {2 * p['batch_groups']} groups in flight / {p['batch_groups']} "
                        "groups in flight: engine occupancy over its steps; T_run", "(context)",
                        f"{asy2['occupancy_busy'] or float('nan'):.3f} / {asy['occupancy_busy'] or float('nan'):.3f}; "
                        f"{asy2['T_run']:.1f} s / {asy['T_run']:.1f} s", None, cmd))  # fmt: skip
    first = runs[0]
    sec.details = [
        f"Per run (seconds; T_run = T_total without start-up; T_run_synced = T_run + stages x {t_sync:.2f} s, "
        f"one {p['sync_model']} publish + apply by `{backend}` measured in this invocation; occupancy = running "
        "sequences over max_num_seqs while a stage generated, mean over stages; tail = seconds from the "
        "90th-percentile response's end to the last one's, summed over the generation calls):",
        _table(pairs),
        "Where the time of the first repeat goes (seconds):",
        md_table(["", "GRPO mu=4", "mu-GRPO"],
                 [[k, f"{v:.1f}", f"{breakdown(first[1])[k]:.1f}"] for k, v in breakdown(first[0]).items()]),
        f"Runs: `{first[0].cmd}` and `{first[1].cmd}` (repeats differ in `run.name`); async: `{a_run.cmd}` "
        f"(T_run {asy['T_run']:.1f} s, trainer idle {asy['idle']:.3f}, {asy['drains']} drains before a weight switch "
        f"taking {asy['t_drain_s']:.1f} s in all, the engine's occupancy {asy['occupancy_drain'] or float('nan'):.3f} "
        f"while draining against {asy['occupancy_busy'] or float('nan'):.3f} over all its steps); with "
        f"{2 * p['batch_groups']} groups in flight: T_run {asy2['T_run']:.1f} s, trainer idle {asy2['idle']:.3f}, "
        f"{asy2['drains']} drains taking {asy2['t_drain_s']:.1f} s, occupancy "
        f"{asy2['occupancy_drain'] or float('nan'):.3f} while draining and "
        f"{asy2['occupancy_busy'] or float('nan'):.3f} over all steps.",
    ]  # fmt: skip
    sec.data = {"pairs": pairs, "t_sync_s": t_sync, "sync_backend": backend, "async": asy, "async_2x": asy2}
    return sec
