"""The staged (sync) pipeline: Ray actors wired together, stage by stage.

Per stage k: rollout workers (holding policy version k * mu) generate B_train = mu * B_mini groups,
scored and with advantages; the stage dataset is written to ``rollouts/stage-K/``; the trainer ranks
run mu updates over a seeded permutation of it; then the trainer publishes its weights once as an
object ref and every worker loads that same ref in place.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
from tqdm import tqdm

from actors.rollout import RolloutWorker, engine_env
from actors.trainer import TrainerRank
from mugrpo_async.config import Config, save_config
from mugrpo_async.data import PromptStream, synthetic_prompts
from mugrpo_async.metrics import MetricsSink, update_record
from mugrpo_async.store import StageWriter

log = logging.getLogger(__name__)


def start_ray(cfg: Config) -> None:
    """Connect to the cluster in RAY_ADDRESS (``ray job submit``) or start a local one."""
    if ray.is_initialized():
        return
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.getcwd()}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=env, log_to_driver=True)
        return
    ray.init(
        address="local",  # always a fresh local cluster unless RAY_ADDRESS names one
        include_dashboard=cfg.run.dashboard,
        dashboard_host="127.0.0.1",
        runtime_env=env,
        log_to_driver=True,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_resources(cfg: Config) -> None:
    """Fail fast, naming the keys, when the actors ask for more CPUs/GPUs than the cluster has.

    Every actor reserves its ``cpus_per_*`` / ``gpus_per_*``; Ray never places more than a node has,
    so an over-large request would wait forever instead of oversubscribing. Reward tasks reserve
    nothing (they run on their rollout worker's reservation while it waits for them).
    """
    r, t = cfg.rollout, cfg.trainer
    have = ray.cluster_resources()
    need = {"CPU": r.num_workers * r.cpus_per_worker + t.num_ranks * t.cpus_per_rank,
            "GPU": r.num_workers * r.gpus_per_worker + t.num_ranks * t.gpus_per_rank}  # fmt: skip
    for res, amount in need.items():
        if amount > have.get(res, 0.0) + 1e-9:
            raise ResourceError(
                f"the actors need {amount:g} {res}s but the cluster has {have.get(res, 0.0):g}: lower "
                f"rollout.num_workers / trainer.num_ranks or rollout.{res.lower()}s_per_worker / "
                f"trainer.{res.lower()}s_per_rank (fractions share a device)"
            )


class ResourceError(RuntimeError):
    """The configured actors do not fit the cluster."""


def start_actors(cfg: Config) -> tuple[list, list]:
    """Create the trainer ranks and rollout workers and wait until all are ready."""
    check_resources(cfg)
    d = cfg.to_dict()
    addr, port = ray.util.get_node_ip_address(), _free_port()
    n = cfg.trainer.num_ranks
    trainers = [
        TrainerRank.options(num_cpus=cfg.trainer.cpus_per_rank, num_gpus=cfg.trainer.gpus_per_rank).remote(
            d, rank, n, addr, port
        )
        for rank in range(n)
    ]
    workers = [
        RolloutWorker.options(
            num_cpus=cfg.rollout.cpus_per_worker,
            num_gpus=cfg.rollout.gpus_per_worker,
            runtime_env={"env_vars": engine_env(cfg)},
        ).remote(d, i)
        for i in range(cfg.rollout.num_workers)
    ]
    ray.get([w.info.remote() for w in workers] + [t.__ray_ready__.remote() for t in trainers])
    return trainers, workers


def generate_stage(cfg: Config, workers: list, prompts: list[dict], writer: StageWriter, bar) -> tuple[list, dict]:
    """Generate one group per prompt across the workers; shards are written as batches return."""
    n = len(workers)
    chunk = -(-len(prompts) // (n * 2)) if len(prompts) > n else 1
    pending = {}
    for i, start in enumerate(range(0, len(prompts), chunk)):
        pending[workers[i % n].generate.remote(prompts[start : start + chunk])] = start
    results = {}
    stats = {"num_tokens": 0, "reward_failures": 0, "t_generate_s": 0.0, "t_reward_s": 0.0}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        out = ray.get(done[0])
        results[pending.pop(done[0])] = out["groups"]
        writer.add(out["groups"])
        for key in stats:
            stats[key] += out[key]
        bar.update(len(out["groups"]))
    groups = [g for start in sorted(results) for g in results[start]]
    return groups, stats


def run_stage(cfg: Config, k: int, trainers: list, workers: list, stream, sink, run_dir: Path, t_run0: float):
    """One sync stage: rollout, mu updates, weight broadcast. Returns the stage record."""
    s, bar_on = cfg.schedule, cfg.logging.progress
    t0 = time.perf_counter()
    writer = StageWriter(run_dir / "rollouts" / f"stage-{k}", k, cfg.digest())
    with tqdm(total=s.groups_per_stage, desc=f"stage {k} rollout", disable=not bar_on, leave=False) as bar:
        groups, gstats = generate_stage(cfg, workers, stream.take(s.groups_per_stage), writer, bar)
    writer.finish()
    t_rollout = time.perf_counter() - t0
    stage_ref = ray.put(groups)
    ray.get([t.load_stage.remote(stage_ref) for t in trainers])
    perm = np.random.default_rng([cfg.run.seed, k]).permutation(len(groups))
    version = k * s.mu
    for u in tqdm(range(s.mu), desc=f"stage {k} train", disable=not bar_on, leave=False):
        idx = perm[u * s.groups_per_update : (u + 1) * s.groups_per_update].tolist()
        rank_metrics = ray.get([t.update.remote(idx) for t in trainers])
        rec = update_record(rank_metrics, update=version + u + 1, policy_version=version)
        rec["t_wall_s"] = time.perf_counter() - t_run0
        sink.write(rec)
    t_train = time.perf_counter() - t0 - t_rollout
    t1 = time.perf_counter()
    packed = [t.export_weights.remote() for t in trainers]
    ray.get([w.update_weights.remote(packed[0]) for w in workers])
    t_sync = time.perf_counter() - t1
    rewards = [r for g in groups for r in g.rewards]
    return {
        "kind": "stage", "stage": k, "t_rollout_s": t_rollout, "t_train_s": t_train, "t_weight_sync_s": t_sync,
        "reward_mean": float(np.mean(rewards)), "groups": len(groups), "policy_version": version,
        "response_tokens": gstats["num_tokens"], "reward_failures": gstats["reward_failures"],
        "t_generate_s": gstats["t_generate_s"], "t_reward_s": gstats["t_reward_s"],
        "t_wall_s": time.perf_counter() - t_run0,
    }  # fmt: skip


@dataclass
class Run:
    """What both modes share once set up: the run folder, prompts, actors and the metrics sink."""

    cfg: Config
    run_dir: Path
    prompts: list[dict]
    prompts_dropped: int
    trainers: list
    workers: list
    sink: MetricsSink
    t0: float
    t_setup: float

    def finish(self, summary: dict) -> dict:
        """Save the final HF checkpoint and write the end record (``summary`` plus run totals)."""
        final = self.run_dir / "checkpoints" / "final"
        ray.get([t.save_hf.remote(str(final)) for t in self.trainers])
        summary = {"kind": "end", **summary, "T_setup": self.t_setup, "T_total": time.perf_counter() - self.t0,
                   "prompts_dropped": self.prompts_dropped, "updates": self.cfg.schedule.total_updates,
                   "checkpoint": str(final)}  # fmt: skip
        self.sink.write(summary)
        return summary

    def close(self) -> None:
        self.sink.close()
        for actor in self.trainers + self.workers:
            ray.kill(actor)


def prepare_run(cfg: Config) -> Run:
    """Run folder, resolved config, prompts, Ray and the actors (both modes)."""
    from transformers import AutoTokenizer

    run_dir = Path(cfg.run.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    prompts, dropped = synthetic_prompts(cfg, tokenizer)
    t0 = time.perf_counter()
    start_ray(cfg)
    trainers, workers = start_actors(cfg)
    sink = MetricsSink(run_dir, tensorboard=cfg.logging.tensorboard)
    ray.get([t.start_clock.remote() for t in trainers])
    return Run(cfg, run_dir, prompts, dropped, trainers, workers, sink, t0, time.perf_counter() - t0)


def run_sync(cfg: Config) -> dict:
    """The whole staged run; returns the end-of-run summary (also written to metrics.jsonl)."""
    run = prepare_run(cfg)
    stream = PromptStream(run.prompts, seed=cfg.run.seed)
    stages = []
    try:
        for k in range(cfg.schedule.num_stages):
            rec = run_stage(cfg, k, run.trainers, run.workers, stream, run.sink, run.run_dir, run.t0)
            run.sink.write(rec)
            stages.append(rec)
            log.info(
                "stage %d: reward %.3f, rollout %.1fs, train %.1fs, sync %.2fs",
                k, rec["reward_mean"], rec["t_rollout_s"], rec["t_train_s"], rec["t_weight_sync_s"],
            )  # fmt: skip
        return run.finish({
            "T_rollout": sum(r["t_rollout_s"] for r in stages), "T_train": sum(r["t_train_s"] for r in stages),
            "T_weight_sync": sum(r["t_weight_sync_s"] for r in stages),
            "reward_per_stage": [r["reward_mean"] for r in stages],
        })  # fmt: skip
    finally:
        run.close()
