"""The staged (sync) mode: rollout, mu updates, weight broadcast, stage after stage, resumable anywhere.

Per stage k: the rollout workers (holding policy version k * mu) generate B_train = mu * B_mini
groups, scored and with advantages, in chunks bounded in groups and response tokens
(:mod:`mugrpo_async.rollout.chunks`); each chunk becomes a shard of ``rollouts/stage-K/`` as it
returns, and the driver keeps only the stage's index (where each group lies, and its rewards). The trainer ranks
receive that index and read each minibatch's groups from the shards as they run mu updates over a seeded
permutation of the stage (update U+1
submitted before U is recorded, :mod:`drivers.pipeline`), evaluating (on every rollout worker,
:mod:`drivers.periodic_eval`) and checkpointing when :class:`~mugrpo_async.training.schedule.Schedule`
says so, and at the stage's end publish their weights once as an object ref that every worker loads
in place.

Resuming at update U (the newest valid checkpoint): stage U // mu's prompts are the same (the prompt
stream is positioned at k * B_train), a complete stage dataset is reused as is, an incomplete one
gets only its missing (or corrupt) chunks generated, and the updates continue at U % mu with the
same permutation, so the update sequence and, for the same stage datasets, the weights match an
uninterrupted run.

Colocated devices (``placement.mode = colocated``): the engines and the ranks take turns on each device at the
phase boundaries, in the order of :class:`mugrpo_async.colocation.Colocation` (the ranks offload, the engines
wake, load the next stage's weights at the stage's end and generate; then sleep while the ranks reload and
train); each stage record lists the steps taken (``colocation_steps``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import ray
from tqdm import tqdm

from drivers.colocated import colocation
from drivers.periodic_eval import PeriodicEval
from drivers.pipeline import Step, UpdatePipeline
from drivers.run import Run, prepare_run
from mugrpo_async.colocation import Colocation
from mugrpo_async.config import Config
from mugrpo_async.data.pool import PromptStream
from mugrpo_async.reporting.metrics import read_metrics, update_record
from mugrpo_async.rollout.chunks import ChunkPlan, chunk_plan, plan_for_stage
from mugrpo_async.rollout.dynamic_sampling import StageFilter
from mugrpo_async.rollout.replay import replayed_dir
from mugrpo_async.rollout.samples import SampleError
from mugrpo_async.rollout.shards import MANIFEST, StageWriter, stage_index

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


SHARD_STATS = ("num_tokens", "reward_failures", "t_generate_s", "t_reward_s", "engine_seq_s", "engine_capacity_s",
               "engine_tail_s")  # fmt: skip
"""What each shard's manifest entry keeps of its generation call (summed over a stage's shards)."""


def rollout_stage(run: Run, k: int, stream: PromptStream) -> tuple[list, dict]:
    """Stage k's dataset: reused from disk where complete, generated where missing. Returns (a
    `~mugrpo_async.rollout.shards.GroupRef` per group, stats): the driver holds the stage's index, not its data.

    With ``rollout.dynamic_sampling`` the stage then keeps only informative groups and generates refill rounds
    (`mugrpo_async.rollout.dynamic_sampling`), each into ``rollouts/stage-K/refill-R/``, so a resumed stage reuses
    them as it reuses its own chunks.
    """
    cfg, s = run.cfg, run.cfg.schedule
    stream.cursor = k * s.groups_per_stage  # stage k's prompts do not depend on what ran before
    prompts = _seeded(cfg, stream.take(s.groups_per_stage), k, 0)
    stage_dir = run.run_dir / "rollouts" / f"stage-{k}"
    groups, stats = _dataset(run, k, stage_dir, prompts, f"stage {k}")
    if cfg.rollout.dynamic_sampling:
        groups, more = _refill(run, k, stage_dir, groups)
        stats = {key: stats[key] + more.pop(key, 0) for key in stats} | more
    return groups, stats


def _seeded(cfg: Config, prompts: list[dict], k: int, offset: int) -> list[dict]:
    """With ``rollout.seeded_sampling`` the i-th prompt of stage k (after ``offset`` others) always gets the same
    samples."""
    if not cfg.rollout.seeded_sampling:
        return prompts
    return [{**p, "seed": (cfg.run.seed * 1_000_003 + k) * 1_000_003 + offset + i} for i, p in enumerate(prompts)]


def _refill(run: Run, k: int, stage_dir: Path, groups: list) -> tuple[list, dict]:
    """Dynamic sampling: refill rounds of new prompts (a stream of the stage's own) until the stage holds B_train
    informative groups or ``rollout.max_refill_rounds`` is reached; returns (the stage's groups, summed stats of the
    rounds plus the counts of `StageFilter.stage`)."""
    cfg = run.cfg
    filt = StageFilter(cfg.schedule.groups_per_stage)
    filt.add(groups)
    refills = PromptStream(run.prompts, seed=cfg.run.seed * 1_000_003 + 7_919 * (k + 1))
    totals: dict = {}
    rewards = [r for g in groups for r in g.rewards]
    while n := filt.next_round(cfg.rollout.max_refill_rounds):
        filt.rounds += 1
        offset = refills.cursor + filt.target
        prompts = _seeded(cfg, refills.take(n), k, offset)
        more, stats = _dataset(run, k, stage_dir / f"refill-{filt.rounds}", prompts, f"stage {k} refill {filt.rounds}")
        filt.add(more)
        rewards += [r for g in more for r in g.rewards]
        for key, v in stats.items():
            if key != "chunk_size":
                totals[key] = totals.get(key, 0) + v
    out, counts = filt.stage()
    log.info("stage %d: dynamic sampling kept %d of %d groups after %d refill rounds", k, len(filt.kept),
             filt.generated, filt.rounds)  # fmt: skip
    if counts["groups_short"]:
        log.warning("stage %d: %d informative groups short after rollout.max_refill_rounds=%d; filled with "
                    "equal-reward groups", k, counts["groups_short"], cfg.rollout.max_refill_rounds)  # fmt: skip
    # The policy's reward over everything it generated, not only the kept (informative) groups.
    return out, totals | counts | {"reward_mean": float(np.mean(rewards))}


def _dataset(run: Run, k: int, stage_dir: Path, prompts: list[dict], desc: str) -> tuple[list, dict]:
    """One generated dataset in ``stage_dir`` (a stage, or one refill round of it), reused where complete; with
    ``rollout.replay_dir``, the earlier run's dataset in its place, read as it is."""
    cfg = run.cfg
    if cfg.rollout.replay_dir:
        source = replayed_dir(cfg, run.run_dir, stage_dir)
        manifest, groups = stage_index(source)
        log.info("%s: replaying the %d groups of %s", desc, len(groups), source)
        done = {"shards_reused": len(manifest["shards"]), "shards_generated": 0, "shards_corrupt": 0}
        wall = 0.0  # this run spent no time generating it
    else:
        manifest, groups, done = _generated(run, k, stage_dir, prompts, desc)
        wall = manifest.get("rollout_wall_s", 0.0)
    if [g.prompt_id for g in groups] != [p["prompt_id"] for p in prompts]:
        raise SampleError(f"{stage_dir}: the stage's groups do not match its prompts one for one")
    shards = manifest["shards"]
    stats = {key: sum(e.get(key, 0) for e in shards) for key in SHARD_STATS}
    stats.update(t_rollout_s=wall, chunk_size=manifest["plan"]["chunk_size"], **done)
    return groups, stats


def _generated(run: Run, k: int, stage_dir: Path, prompts: list[dict], desc: str) -> tuple[dict, list, dict]:
    """(manifest, a `GroupRef` per group, counts and faults) of the dataset in ``stage_dir``, its missing chunks
    generated."""
    cfg = run.cfg
    plan = _stage_plan(cfg, stage_dir, len(prompts), len(run.workers))  # a reopened stage keeps its own plan
    writer = StageWriter.open(stage_dir, k, cfg.resume_digest(), plan.num_chunks, plan.chunk_size)
    missing = writer.missing()
    t0 = time.perf_counter()
    faults = {}
    if missing:
        chunks = {c: plan.chunk(prompts, c) for c in missing}
        log.info("%s: generating %d of %d chunks of up to %d groups", desc, len(chunks), plan.num_chunks,
                 plan.chunk_size)  # fmt: skip
        bar = tqdm(total=sum(map(len, chunks.values())), desc=f"{desc} rollout", leave=False,
                   disable=not cfg.logging.progress)  # fmt: skip

        def keep(c: int, out: dict) -> None:
            stats = {key: out[key] for key in SHARD_STATS if key in out}
            writer.add(out["groups"], c, stats)
            bar.update(len(out["groups"]))
            run.status.add(len(out["groups"]), out["num_tokens"])

        faults = run.pool.generate(chunks, keep)
        bar.close()
        writer.add_wall(time.perf_counter() - t0)
    writer.finish()
    done = {"shards_reused": plan.num_chunks - len(missing), "shards_generated": len(missing),
            "shards_corrupt": len(writer.corrupt), **faults}  # fmt: skip
    # where each group lies: the trainer ranks read their minibatches from the shards
    return writer.manifest, writer.all_refs(), done


MISMATCH_KEYS = ("mismatch_logprob_abs_mean", "mismatch_logprob_abs_max", "mismatch_kl")
"""Train/inference mismatch of the stage's first update (its rows are all lag 0), copied into the stage record."""


def run_stage(run: Run, k: int, stream: PromptStream, peval: PeriodicEval, bar: tqdm,
              ctl: Colocation | None = None) -> dict:  # fmt: skip
    """One sync stage from wherever the run stands in it; returns the stage record.

    ``ctl``: colocated devices (`drivers.colocated`): the engines have the devices while the stage is generated and
    from the stage's end on (new weights, evaluation), the trainer ranks while they update.
    """
    sched = run.sched
    t0 = time.perf_counter()
    if ctl is not None:
        ctl.to_rollout()  # a no-op after the previous stage's end; at a run's start: the ranks offload
    groups, gstats = rollout_stage(run, k, stream)
    t_rollout_here = time.perf_counter() - t0
    if ctl is not None:
        ctl.to_training()
    first, todo = _train_stage(run, k, groups, peval, bar, ctl)
    version = k * sched.mu
    U = version + sched.mu  # the stage's end
    rewards = [r for g in groups for r in g.rewards]
    rec = {"kind": "stage", "stage": k, "t_rollout_s": gstats.pop("t_rollout_s"),
           "t_train_s": time.perf_counter() - t0 - t_rollout_here, "reward_mean": float(np.mean(rewards)),
           "groups": len(groups), "policy_version": version, "response_tokens": gstats.pop("num_tokens"),
           "resumed_at_update": todo.start - 1 if todo.start - 1 > version else None,
           "engine_occupancy": _occupancy(gstats.pop("engine_seq_s"), gstats.pop("engine_capacity_s")), **gstats,
           **stage_mismatch(first, run.run_dir, version + 1)}  # fmt: skip
    t1 = time.perf_counter()
    if ctl is None:
        run.weights.broadcast(U)  # sched.after(U).publish: the next stage's behaviour policy (weight_sync.backend)
    else:  # the engines wake and load the next stage's weights; the ranks' states go to host memory first
        ctl.to_rollout(lambda: run.weights.broadcast(U))
        rec["colocation_steps"] = ctl.take_steps()
    rec["t_weight_sync_s"] = time.perf_counter() - t1  # pack on the trainer + load in every engine (+ phase switch)
    due = sched.after(U)
    if due.evaluate:
        peval.evaluate_now(U, load=False)  # every worker holds update U's weights (the broadcast above)
    rec["t_wall_s"] = time.perf_counter() - run.t0
    run.sink.write(rec)
    if due.checkpoint:  # after the stage record: a run resumed here starts the next stage
        run.checkpoint(U, {"stage": k})
    return rec


def _occupancy(seq_s: float, capacity_s: float) -> float | None:
    """The stage's engine occupancy: running sequences over max_num_seqs while its calls generated (None: the stage
    was reused or replayed, nothing generated here)."""
    return seq_s / capacity_s if capacity_s > 0 else None


def _train_stage(run: Run, k: int, groups: list, peval: PeriodicEval, bar: tqdm, ctl: Colocation | None):
    """The stage's updates from wherever the run stands in it; (the record of its first update when this call ran
    it, the updates run)."""
    cfg, sched = run.cfg, run.sched
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
        if due.stage_end or not due.barrier:  # the stage's end is handled by run_stage, after the loop
            continue
        pipe.drain()  # nothing in flight: the trainer holds update U's weights
        if due.evaluate:
            _evaluate_mid_stage(run, peval, U, ctl)
        if due.checkpoint:
            pipe.seal_after_next(run.begin_checkpoint(U, {"stage": k}).commit)
    pipe.close()
    return first, todo


def _evaluate_mid_stage(run: Run, peval: PeriodicEval, U: int, ctl: Colocation | None) -> None:
    """Evaluate update U's weights inside a stage; colocated engines wake for it and sleep again after."""
    if ctl is None:
        peval.evaluate_now(U)
        return
    ctl.to_rollout(lambda: run.weights.broadcast(U))
    peval.evaluate_now(U, load=False)
    ctl.to_training()


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
            ctl = colocation(run)  # None unless placement.mode is colocated
            for k in run.sched.stages(run.start_update):
                rec = run_stage(run, k, stream, peval, bar, ctl)
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
