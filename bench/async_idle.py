"""Benchmark 4, async: trainer idle ratio with 1 and 2 rollout workers, and T_total against the staged mode.

Async mu-GRPO (``configs/tiny-cpu-async.yaml``: 128 updates of B_mini = 16 groups, weights published
every 4 updates, lag cap 1024) against the staged mu-GRPO run of benchmark 1 (same model, samples and
updates). Two workers share one CPU reservation (``rollout.cpus_per_worker=0.5``) so that the actors fit
2 cores. Besides the cumulative idle ratio of the run (the trainer's own figure, which includes waiting
for the first minibatch), it gives the steady-state ratio (updates after the first) and the rollout
capacity: groups generated per second of generation (time a worker was held back by the queue left
out) against the groups per second the trainer could consume (B_mini / median step time). Capacity
below 1 means the trainer must wait whatever the pipeline does.

    .venv/bin/python -m bench.run --only 4 [--smoke]
"""

from __future__ import annotations

import statistics

from bench import staging
from bench.common import REPO, Row, Section, TrainRun, bench_command, md_table, ratio, train

FULL = ["schedule.total_updates=128"]
SUFFICIENT = "qwen2-4m"  # benchmark 3's 4M-parameter Qwen2 (random weights, the tiny tokenizer)
SMOKE = [
    "schedule.total_updates=4",
    "schedule.groups_per_update=4",
    "rollout.batch_groups=4",
    "schedule.queue_max_groups=16",
    "schedule.sync_every=1",  # publishes within 4 updates
]


def async_run(smoke: bool, workers: int) -> TrainRun:
    extra = [] if workers == 1 else [f"rollout.num_workers={workers}", f"rollout.cpus_per_worker={1 / workers:g}"]
    return train([*(SMOKE if smoke else FULL), *extra], config="configs/tiny-cpu-async.yaml")


def sufficient_run(smoke: bool) -> TrainRun:
    """Async with a model whose generation outpaces its training on these cores (capacity above 1)."""
    from bench.weight_sync import model_folder

    return train([*(SMOKE if smoke else FULL), f"model.path={model_folder(SUFFICIENT).relative_to(REPO)}"],
                 config="configs/tiny-cpu-async.yaml")  # fmt: skip


def idle_stats(run: TrainRun) -> dict:
    """Cumulative and steady-state idle ratio, and the rollout capacity ratio of an async run."""
    u = run.updates
    later = u[1:] or u
    steady = sum(r["t_wait_s"] for r in later) / max(sum(r["t_wait_s"] + r["t_step_s"] for r in later), 1e-9)
    b_mini = run.end["served"] / max(len(u), 1)
    demand = b_mini / statistics.median(r["t_step_s"] for r in u)  # groups/s the trainer could take
    # groups/s the workers can produce: each one's groups over the time it was not held back by the queue
    # (a full queue or a spent lag budget), so that a backpressured worker is not mistaken for a slow one
    workers = run.end.get("workers") or [{"produced": run.end["generated"], "t_blocked_s": 0.0}]
    supply = sum(w["produced"] / max(run.t_run - w.get("t_blocked_s", 0.0), 1e-9) for w in workers)
    return {
        "idle": run.end["trainer_idle_ratio"],
        "idle_steady": steady,
        "capacity": supply / demand,
        "supply_groups_s": supply,
        "demand_groups_s": demand,
        "T_total": run.end["T_total"],
        "T_run": run.t_run,
        "reward_last_quarter": run.end["reward_last_quarter"],
        "first_wait_s": u[0]["t_wait_s"],
        "updates": len(u),
    }


def publish_share(run: TrainRun) -> dict:
    """The trainer's time lost per publish as a share of an update (medians over the run's publishing updates and
    all its updates): ``pack_share`` now (rank 0's pack between two updates) and ``inline_share``, what it was when
    the copy into the object store also ran between the two updates (the same run's pack + store figures)."""
    pubs = [r for r in run.updates if "t_publish_pack_s" in r]
    step = statistics.median(r["t_step_s"] for r in run.updates)
    pack = statistics.median(r["t_publish_pack_s"] for r in pubs) if pubs else float("nan")
    store = statistics.median(r["t_publish_store_s"] for r in pubs) if pubs else float("nan")
    return {"publishes": len(pubs), "step_s": step, "pack_s": pack, "store_s": store, "pack_share": pack / step,
            "inline_share": (pack + store) / step}  # fmt: skip


def _publish_row(label: str, p: dict, cmd: str) -> Row:
    return Row(f"async: trainer's time lost per publish / update time, {label} ({p['publishes']} publishes)",
               "< 5%", f"{p['pack_share']:.2%} (pack {p['pack_s'] * 1e3:.1f} ms of a {p['step_s'] * 1e3:.0f} ms "
               f"update; the copy into the store, {p['store_s'] * 1e3:.1f} ms, runs beside the next update: inline "
               f"it would be {p['inline_share']:.2%})", p["pack_share"] < 0.05, cmd)  # fmt: skip


def _table(staged: TrainRun, results: dict[str, dict]) -> str:
    """The runs side by side (``results``: idle_stats by row label): idle ratios, capacity, times and reward."""
    st = staged.end
    rows = [
        [
            "staged mu-GRPO (benchmark 1)",
            f"{staged.updates[-1]['trainer_idle_ratio']:.3f}",
            "-",
            "-",
            f"{st['T_total']:.1f}",
            f"{staged.t_run:.1f}",
            f"{st['reward_per_stage'][-1]:.3f} (last stage)",
        ]
    ]
    for label, r in results.items():
        rows.append(
            [
                label,
                f"{r['idle']:.3f}",
                f"{r['idle_steady']:.3f}",
                f"{r['supply_groups_s']:.0f} / {r['demand_groups_s']:.0f} = {r['capacity']:.2f}",
                f"{r['T_total']:.1f}",
                f"{r['T_run']:.1f}",
                f"{r['reward_last_quarter']:.3f} (last quarter)",
            ]
        )
    header = [
        "run",
        "idle ratio",
        "steady idle",
        "capacity: supply / demand groups/s",
        "T_total s",
        "T_run s",
        "reward",
    ]
    return md_table(header, rows)


def _limit(r: dict) -> str:
    """What keeps the idle ratio of a run whose capacity suffices above 1%."""
    if r["capacity"] < 1:
        return f"rollout capacity {r['capacity']:.2f} did not suffice in this run"
    fill = r["first_wait_s"] / max(r["T_run"], 1e-9)
    return (
        f"the pipeline fill (the trainer waits {r['first_wait_s']:.1f} s for the first minibatch, {fill:.1%} of "
        f"the run) weighs on a {r['updates']}-update run; after it the trainer idles {r['idle_steady']:.1%}"
    )


def run(smoke: bool) -> Section:
    _, staged = staging.runs(smoke)
    tiny = {w: idle_stats(async_run(smoke, w)) for w in ((1,) if smoke else (1, 2))}  # by worker count
    suff = idle_stats(sufficient_run(smoke))
    cmd = bench_command(4, smoke)
    cap = max(r["capacity"] for r in tiny.values())
    sec = Section(4, "Async: trainer idle ratio with 1 and 2 rollout workers, T_total against staged")
    sec.rows = [
        Row(f"trainer idle ratio, async, 1 worker, {SUFFICIENT} (capacity {suff['capacity']:.2f}), whole run",
            "<= 1% when rollout capacity suffices", f"{suff['idle']:.2%}",
            suff["idle"] <= 0.01 if suff["capacity"] >= 1 else None, cmd, _limit(suff)),
        Row("the same after the first minibatch (steady state)", "(context)", f"{suff['idle_steady']:.2%}", None, cmd),
    ]  # fmt: skip
    sec.rows += [
        Row(f"trainer idle ratio, async, {w} worker(s), tiny model (capacity {r['capacity']:.2f})", "(context)",
            f"{r['idle']:.1%}; steady {r['idle_steady']:.1%}", None, cmd)
        for w, r in tiny.items()
    ]  # fmt: skip
    sec.rows += [
        Row(f"T_total staged / async, {w} worker(s), without start-up", "(context)",
            f"{ratio(staged.t_run, r['T_run']):.2f}x", None, cmd)
        for w, r in tiny.items()
    ]  # fmt: skip
    shares = {"tiny model": publish_share(async_run(smoke, 1)), SUFFICIENT: publish_share(sufficient_run(smoke))}
    sec.rows += [_publish_row(label, p, cmd) for label, p in shares.items()]
    if smoke:
        sec.rows.append(Row("2 workers", "(context)", "not run in the smoke version", None, cmd))
    runs = ", ".join(f"`{async_run(smoke, w).cmd}`" for w in tiny) + f", `{sufficient_run(smoke).cmd}`"
    labelled = {f"async, {w} worker(s)": r for w, r in tiny.items()} | {f"async, 1 worker, {SUFFICIENT}": suff}
    sec.details = [
        _table(staged, labelled),
        f"Runs: {runs}; staged: `{staged.cmd}`.",
        f"With the tiny model the rollout capacity does not suffice on 2 cores (at most {cap:.2f}: the workers supply "
        f"that share of the groups per second the trainer could consume, so the trainer waits at least "
        f"{1 - min(cap, 1):.0%} of the time). The {SUFFICIENT} model (random weights, so its responses run to the "
        "token cap) trains slower per token than its engine generates, so one worker outpaces the trainer.",
    ]
    sec.data = {"async": {**tiny, SUFFICIENT: suff}, "staged_idle": staged.updates[-1]["trainer_idle_ratio"],
                "publish": shares}  # fmt: skip
    return sec
