"""The staged (sync) mode: rollout, mu updates, weight broadcast, stage after stage, resumable anywhere.

Per stage k: the rollout workers (holding policy version k * mu) generate B_train = mu * B_mini
groups, scored and with advantages, in chunks bounded in groups and response tokens
(:mod:`mugrpo_async.rollout.chunks`); each chunk becomes a shard of ``rollouts/stage-K/`` as it
returns. The trainer ranks then run mu updates over a seeded permutation of the stage (update U+1
submitted before U is recorded, :mod:`drivers.pipeline`), evaluating (on every rollout worker,
:mod:`drivers.periodic_eval`) and checkpointing when :class:`~mugrpo_async.training.schedule.Schedule`
says so, and at the stage's end publish their weights once as an object ref that every worker loads
in place.

Resuming at update U (the newest valid checkpoint): stage U // mu's prompts are the same (the prompt
stream is positioned at k * B_train), a complete stage dataset is reused as is, an incomplete one
gets only its missing (or corrupt) chunks generated, and the updates continue at U % mu with the
same permutation, so the update sequence and, for the same stage datasets, the weights match an
uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import ray
from tqdm import tqdm

from drivers.periodic_eval import PeriodicEval
from drivers.pipeline import Step, UpdatePipeline
from drivers.run import Run, prepare_run
from mugrpo_async.config import Config
from mugrpo_async.data.pool import PromptStream
from mugrpo_async.reporting.metrics import read_metrics, update_record
from mugrpo_async.rollout.chunks import ChunkPlan, chunk_plan, plan_for_stage
from mugrpo_async.rollout.samples import SampleError
from mugrpo_async.rollout.shards import MANIFEST, StageWriter

log = logging.getLogger(__name__)


def _stage_plan(cfg: Config, stage_dir: Path, n_prompts: int, n_workers: int) -> ChunkPlan:
    """The stage's chunk plan: the one its manifest holds if the stage was begun earlier, else a new one."""
    r = cfg.rollout
    new = chunk_plan(n_prompts, n_workers, r.group_size, r.max_new_tokens, r.chunk_groups, r.chunk_tokens)
    try:
        stored = json.loads((stage_dir / MANIFEST).read_text()).get("plan")
    except (OSError, ValueError):  # none yet (an unreadable one is StageWriter.open's to report)
        stored = None
    return plan_for_stage(stored, new)


def rollout_stage(run: Run, k: int, stream: PromptStream) -> tuple[list, dict]:
    """Stage k's dataset: reused from disk where complete, generated where missing. Returns (groups, stats)."""
    cfg, s = run.cfg, run.cfg.schedule
    stream.cursor = k * s.groups_per_stage  # stage k's prompts do not depend on what ran before
    prompts = stream.take(s.groups_per_stage)
    if cfg.rollout.seeded_sampling:  # the i-th prompt of stage k always gets the same samples
        prompts = [{**p, "seed": (cfg.run.seed * 1_000_003 + k) * 1_000_003 + i} for i, p in enumerate(prompts)]
    stage_dir = run.run_dir / "rollouts" / f"stage-{k}"
    plan = _stage_plan(cfg, stage_dir, len(prompts), len(run.workers))  # a reopened stage keeps its own plan
    writer = StageWriter.open(stage_dir, k, cfg.resume_digest(), plan.num_chunks, plan.chunk_size)
    missing = writer.missing()
    t0 = time.perf_counter()
    faults = {}
    if missing:
        chunks = {c: plan.chunk(prompts, c) for c in missing}
        log.info("stage %d: generating %d of %d chunks of up to %d groups", k, len(chunks), plan.num_chunks,
                 plan.chunk_size)  # fmt: skip
        bar = tqdm(total=sum(map(len, chunks.values())), desc=f"stage {k} rollout", leave=False,
                   disable=not cfg.logging.progress)  # fmt: skip

        def keep(c: int, out: dict) -> None:
            stats = {key: out[key] for key in ("num_tokens", "reward_failures", "t_generate_s", "t_reward_s")}
            writer.add(out["groups"], c, stats)
            bar.update(len(out["groups"]))

        faults = run.pool.generate(chunks, keep)
        bar.close()
        writer.add_wall(time.perf_counter() - t0)
    writer.finish()
    groups = writer.all_groups()
    if [g.prompt_id for g in groups] != [p["prompt_id"] for p in prompts]:
        raise SampleError(f"{stage_dir}: the stage's groups do not match its prompts one for one")
    shards = writer.manifest["shards"]
    stats = {key: sum(e.get(key, 0) for e in shards) for key in ("num_tokens", "reward_failures", "t_generate_s",
                                                                  "t_reward_s")}  # fmt: skip
    stats.update(t_rollout_s=writer.manifest.get("rollout_wall_s", 0.0), shards_reused=plan.num_chunks - len(missing),
                 shards_generated=len(missing), shards_corrupt=len(writer.corrupt), chunk_size=plan.chunk_size,
                 **faults)  # fmt: skip
    return groups, stats


MISMATCH_KEYS = ("mismatch_logprob_abs_mean", "mismatch_logprob_abs_max", "mismatch_kl")
"""Train/inference mismatch of the stage's first update (its rows are all lag 0), copied into the stage record."""


def run_stage(run: Run, k: int, stream: PromptStream, peval: PeriodicEval, bar: tqdm) -> dict:
    """One sync stage from wherever the run stands in it; returns the stage record."""
    cfg, sched = run.cfg, run.sched
    t0 = time.perf_counter()
    groups, gstats = rollout_stage(run, k, stream)
    t_rollout_here = time.perf_counter() - t0
    run.on_trainers("load_stage", ray.put(groups))
    perm = np.random.default_rng([cfg.run.seed, k]).permutation(len(groups))
    B, version = cfg.schedule.groups_per_update, k * sched.mu  # the stage's updates train from version k * mu
    first: dict = {}

    def record(step: Step) -> None:
        rec = update_record(run.collect(step.refs, "update"), update=step.update, policy_version=version)
        run.write_update(rec)
        if step.update == version + 1:
            first.update(rec)
        bar.update()

    pipe = UpdatePipeline(record)
    todo = sched.stage_updates(k, run.start_update)
    for U in todo:
        u = U - version - 1  # position in the stage's permutation
        pipe.push(Step(U, run.submit("update", perm[u * B : (u + 1) * B].tolist())))
        due = sched.after(U)
        if due.stage_end or not due.barrier:  # the stage's end is handled below, after the loop
            continue
        pipe.drain()  # nothing in flight: the trainer holds update U's weights
        if due.evaluate:
            peval.evaluate_now(U)
        if due.checkpoint:
            pipe.seal_after_next(run.begin_checkpoint(U, {"stage": k}).commit)
    pipe.close()

    U = version + sched.mu  # the stage's end
    rewards = [r for g in groups for r in g.rewards]
    rec = {"kind": "stage", "stage": k, "t_rollout_s": gstats.pop("t_rollout_s"),
           "t_train_s": time.perf_counter() - t0 - t_rollout_here, "reward_mean": float(np.mean(rewards)),
           "groups": len(groups), "policy_version": version, "response_tokens": gstats.pop("num_tokens"),
           "resumed_at_update": todo.start - 1 if todo.start - 1 > version else None, **gstats,
           **stage_mismatch(first, run.run_dir, version + 1)}  # fmt: skip
    t1 = time.perf_counter()
    run.pool.broadcast(run.publish(), U)  # sched.after(U).publish: the next stage's behaviour policy
    rec["t_weight_sync_s"] = time.perf_counter() - t1  # pack on the trainer + load in every engine
    due = sched.after(U)
    if due.evaluate:
        peval.evaluate_now(U, load=False)  # every worker holds update U's weights (the broadcast above)
    rec["t_wall_s"] = time.perf_counter() - run.t0
    run.sink.write(rec)
    if due.checkpoint:  # after the stage record: a run resumed here starts the next stage
        run.checkpoint(U, {"stage": k})
    return rec


def stage_mismatch(first: dict, run_dir: Path, update: int) -> dict:
    """The ``mismatch_*`` values of the stage's first update ``update``, whose record is ``first`` (empty: the
    run resumed after it, so it is read back from metrics.jsonl); nothing when the record has none."""
    if not first:
        first = next((r for r in read_metrics(run_dir, "update") if r["update"] == update), {})
    return {key: first[key] for key in MISMATCH_KEYS if key in first}


def run_sync(cfg: Config) -> dict:
    """The whole staged run (continuing a run found in the folder); returns the end-of-run summary."""
    run = prepare_run(cfg)
    stream = PromptStream(run.prompts, seed=cfg.run.seed)
    try:
        with run.stopping():
            peval = PeriodicEval(run)
            bar = tqdm(total=run.sched.total_updates, initial=run.start_update, desc="sync train", unit="update",
                       disable=not cfg.logging.progress)  # fmt: skip
            for k in run.sched.stages(run.start_update):
                rec = run_stage(run, k, stream, peval, bar)
                log.info(
                    "stage %d: reward %.3f, rollout %.1fs (%d shards reused), train %.1fs, sync %.2fs",
                    k, rec["reward_mean"], rec["t_rollout_s"], rec["shards_reused"], rec["t_train_s"],
                    rec["t_weight_sync_s"],
                )  # fmt: skip
            bar.close()
            peval.evaluate_final(worker_holds_final=True)  # every worker holds the last stage's weights
            stages = read_metrics(run.run_dir, "stage")
            return run.finish({
                "T_rollout": sum(r["t_rollout_s"] for r in stages), "T_train": sum(r["t_train_s"] for r in stages),
                "T_weight_sync": sum(r.get("t_weight_sync_s", 0.0) for r in stages),
                "reward_per_stage": [r["reward_mean"] for r in stages],
            })  # fmt: skip
    finally:
        run.close()
