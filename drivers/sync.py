"""The staged (sync) mode: rollout, mu updates, weight broadcast, stage after stage, resumable anywhere.

Per stage k: the rollout workers (holding policy version k * mu) generate B_train = mu * B_mini
groups, scored and with advantages, in fixed chunks; each chunk becomes a shard of
``rollouts/stage-K/`` as it returns. The trainer ranks then run mu updates over a seeded permutation
of the stage, checkpointing every ``checkpoint.every_updates`` and at the stage's end, and publish
their weights once as an object ref that every worker loads in place.

Resuming at update U (the newest valid checkpoint): stage U // mu's prompts are the same (the prompt
stream is positioned at k * B_train), a complete stage dataset is reused as is, an incomplete one
gets only its missing (or corrupt) chunks generated, and the updates continue at U % mu with the
same permutation, so the update sequence and, for the same stage datasets, the weights match an
uninterrupted run.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import ray
from tqdm import tqdm

from drivers.periodic_eval import PeriodicEval
from drivers.run import Run, prepare_run
from mugrpo_async.config import Config
from mugrpo_async.data.pool import PromptStream
from mugrpo_async.reporting.metrics import read_metrics, update_record
from mugrpo_async.rollout.samples import SampleError
from mugrpo_async.rollout.shards import StageWriter

log = logging.getLogger(__name__)


def _chunk_plan(cfg: Config, n_prompts: int, n_workers: int) -> tuple[int, int]:
    """(chunk_size, num_chunks) for one stage: ``rollout.chunk_groups`` or two calls per worker."""
    size = cfg.rollout.chunk_groups or max(1, -(-n_prompts // (2 * max(n_workers, 1))))
    return size, -(-n_prompts // size)


def rollout_stage(run: Run, k: int, stream: PromptStream) -> tuple[list, dict]:
    """Stage k's dataset: reused from disk where complete, generated where missing. Returns (groups, stats)."""
    cfg, s = run.cfg, run.cfg.schedule
    stream.cursor = k * s.groups_per_stage  # stage k's prompts do not depend on what ran before
    prompts = stream.take(s.groups_per_stage)
    if cfg.rollout.seeded_sampling:  # the i-th prompt of stage k always gets the same samples
        prompts = [{**p, "seed": (cfg.run.seed * 1_000_003 + k) * 1_000_003 + i} for i, p in enumerate(prompts)]
    stage_dir = run.run_dir / "rollouts" / f"stage-{k}"
    size, n_chunks = _chunk_plan(cfg, len(prompts), len(run.workers))
    writer = StageWriter.open(stage_dir, k, cfg.resume_digest(), n_chunks, size)
    size = writer.manifest["plan"]["chunk_size"]  # a reopened stage keeps its own plan
    missing = writer.missing()
    t0 = time.perf_counter()
    faults = {}
    if missing:
        chunks = {c: prompts[c * size : (c + 1) * size] for c in missing}
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
    stats.update(t_rollout_s=writer.manifest.get("rollout_wall_s", 0.0), shards_reused=n_chunks - len(missing),
                 shards_generated=len(missing), shards_corrupt=len(writer.corrupt), **faults)  # fmt: skip
    return groups, stats


def run_stage(run: Run, k: int, stream: PromptStream, peval: PeriodicEval) -> dict:
    """One sync stage from wherever the run stands in it; returns the stage record."""
    cfg, s = run.cfg, run.cfg.schedule
    t0 = time.perf_counter()
    groups, gstats = rollout_stage(run, k, stream)
    t_rollout_here = time.perf_counter() - t0
    run.on_trainers("load_stage", ray.put(groups))
    perm = np.random.default_rng([cfg.run.seed, k]).permutation(len(groups))
    version, every = k * s.mu, cfg.checkpoint.every_updates
    first = max(run.start_update - version, 0)

    def record(u: int, refs: list) -> None:
        rec = update_record(run.collect(refs, "update"), update=version + u + 1, policy_version=version)
        rec["t_wall_s"] = time.perf_counter() - run.t0
        run.sink.write(rec)

    inflight = None  # update u+1 is submitted before update u is recorded: the ranks never wait for the driver
    for u in tqdm(range(first, s.mu), desc=f"stage {k} train", disable=not cfg.logging.progress, leave=False):
        idx = perm[u * s.groups_per_update : (u + 1) * s.groups_per_update].tolist()
        step = (u, run.submit("update", idx))
        if inflight is not None:
            record(*inflight)
        inflight = step
        eval_due = peval.due(version + u + 1) and u + 1 < s.mu
        ckpt_due = every and (version + u + 1) % every == 0 and u + 1 < s.mu
        if eval_due or ckpt_due:  # nothing in flight from here to the next update
            record(*inflight)
            inflight = None
        if eval_due:  # mid-stage: worker 0 takes this update's weights
            ray.get(run.workers[0].update_weights.remote(run.publish()))
            peval.evaluate_now(version + u + 1, run.workers[0])
        if ckpt_due:
            run.checkpoint(version + u + 1, {"stage": k})
    if inflight is not None:
        record(*inflight)
    t_train = time.perf_counter() - t0 - t_rollout_here
    rewards = [r for g in groups for r in g.rewards]
    rec = {"kind": "stage", "stage": k, "t_rollout_s": gstats.pop("t_rollout_s"), "t_train_s": t_train,
           "reward_mean": float(np.mean(rewards)), "groups": len(groups), "policy_version": version,
           "response_tokens": gstats.pop("num_tokens"), "resumed_at_update": version + first if first else None,
           **gstats}  # fmt: skip
    t1 = time.perf_counter()
    run.pool.broadcast(run.publish(), version + s.mu)
    rec["t_weight_sync_s"] = time.perf_counter() - t1  # pack on the trainer + load in every engine
    if peval.due(version + s.mu):
        peval.evaluate_now(version + s.mu, run.workers[0])
    rec["t_wall_s"] = time.perf_counter() - run.t0
    run.sink.write(rec)
    run.checkpoint(version + s.mu, {"stage": k})
    return rec


def run_sync(cfg: Config) -> dict:
    """The whole staged run (continuing a run found in the folder); returns the end-of-run summary."""
    run = prepare_run(cfg)
    stream = PromptStream(run.prompts, seed=cfg.run.seed)
    try:
        peval = PeriodicEval(run)
        for k in range(run.start_update // cfg.schedule.mu, cfg.schedule.num_stages):
            rec = run_stage(run, k, stream, peval)
            log.info(
                "stage %d: reward %.3f, rollout %.1fs (%d shards reused), train %.1fs, sync %.2fs",
                k, rec["reward_mean"], rec["t_rollout_s"], rec["shards_reused"], rec["t_train_s"],
                rec["t_weight_sync_s"],
            )  # fmt: skip
        total = cfg.schedule.total_updates
        if peval.enabled and peval.last != total:  # the end of the run is always evaluated
            peval.evaluate_now(total, run.workers[0])
        stages = read_metrics(run.run_dir, "stage")
        return run.finish({
            "T_rollout": sum(r["t_rollout_s"] for r in stages), "T_train": sum(r["t_train_s"] for r in stages),
            "T_weight_sync": sum(r.get("t_weight_sync_s", 0.0) for r in stages),
            "reward_per_stage": [r["reward_mean"] for r in stages],
        })  # fmt: skip
    finally:
        run.close()
