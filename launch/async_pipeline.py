"""The asynchronous pipeline: rollout workers and trainer ranks run at the same time.

Rollout workers loop (``RolloutWorker.run_async``): newest weights -> reserve -> generate -> put. The
driver serves the trainer: per update it gets B_mini groups from the :class:`SampleQueue` (blocking,
with a timeout), hands the same minibatch to every rank, and every ``sync_every`` updates publishes
the weights once (one object ref per version) on the queue's weights board. The staleness cap mu is
the queue's: admission control first, counted drops as the backstop.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import ray
from tqdm import tqdm

from actors.sample_queue import SampleQueue
from launch.pipeline import prepare_run
from mugrpo_async.config import Config
from mugrpo_async.metrics import update_record

log = logging.getLogger(__name__)


def _publish(trainers: list, queue, version: int) -> float:
    t0 = time.perf_counter()
    packed = [t.export_weights.remote() for t in trainers]  # every rank takes part (ZeRO-3 gathers)
    ray.wait(packed, num_returns=len(packed))
    ray.get(queue.publish.remote(version, [packed[0]]))
    return time.perf_counter() - t0


def train_async(cfg: Config, run, queue) -> dict:
    """The update loop; returns the run totals for the end record."""
    s = cfg.schedule
    loops = [w.run_async.remote(queue, run.prompts, cfg.rollout.batch_groups) for w in run.workers]
    rewards, t_sync_total = [], 0.0
    off = not cfg.logging.progress
    gen_bar = tqdm(desc="async rollout (groups)", unit="group", position=1, disable=off)
    for u in tqdm(range(s.total_updates), desc="async train", unit="update", position=0, disable=off):
        groups = ray.get(queue.get.remote(u, s.get_timeout_s))
        if groups is None:
            raise RuntimeError(
                f"no minibatch within schedule.get_timeout_s={s.get_timeout_s}s at update {u + 1}: "
                "rollout workers stalled or died (see their logs)"
            )
        ref = ray.put(groups)
        rec = update_record(ray.get([t.update_groups.remote(ref) for t in run.trainers]), update=u + 1,
                            policy_version=u - u % s.sync_every)  # fmt: skip
        if (u + 1) % s.sync_every == 0:
            rec["t_weight_sync_s"] = _publish(run.trainers, queue, u + 1)
            t_sync_total += rec["t_weight_sync_s"]
        stats = ray.get(queue.stats.remote())
        gen_bar.update(stats["put"] - gen_bar.n)
        rec.update(queue_depth=stats["queue_depth"], dropped=stats["dropped"], t_wall_s=time.perf_counter() - run.t0)
        run.sink.write(rec)
        rewards.append(rec["reward_mean"])
    ray.get(queue.stop.remote())
    worker_stats = ray.get(loops)
    gen_bar.close()
    stats = ray.get(queue.stats.remote())
    return {
        "T_weight_sync": t_sync_total, "trainer_idle_ratio": rec["trainer_idle_ratio"],
        "reward_first_quarter": float(np.mean(rewards[: max(1, len(rewards) // 4)])),
        "reward_last_quarter": float(np.mean(rewards[-max(1, len(rewards) // 4) :])),
        "generated": stats["put"], "served": stats["served"], "dropped": stats["dropped"],
        "left_in_queue": stats["queue_depth"], "workers": worker_stats,
    }  # fmt: skip


def run_async(cfg: Config) -> dict:
    """The whole asynchronous run; returns the end-of-run summary (also written to metrics.jsonl)."""
    run = prepare_run(cfg)
    s = cfg.schedule
    queue = SampleQueue.remote(s.mu, s.groups_per_update, s.queue_capacity, cfg.run.name)
    try:
        totals = train_async(cfg, run, queue)
        log.info(
            "async: %d updates, idle ratio %.3f, generated %d, served %d, dropped %d, left %d",
            s.total_updates, totals["trainer_idle_ratio"], totals["generated"], totals["served"],
            totals["dropped"], totals["left_in_queue"],
        )  # fmt: skip
        return run.finish(totals)
    finally:
        run.close()
        ray.kill(queue)
