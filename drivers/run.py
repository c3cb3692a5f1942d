"""What both modes share: Ray, the actors, the run folder, checkpoints and resuming.

:func:`prepare_run` decides whether the run folder holds a run to continue (``run.resume``), starts
Ray and the actors, and restores the newest valid checkpoint into the trainer ranks and the rollout
workers. :class:`Run` then owns the metrics sink, checkpoints (every rank writes its share into one
folder, sealed atomically) and the way every trainer call reports a dead rank.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.exceptions import RayActorError

from actors.rollout import RolloutWorker, engine_env
from actors.trainer import TrainerRank
from drivers.rollout_pool import RolloutPool
from mugrpo_async.checkpoints.store import CheckpointStore, Resumable, find_resumable
from mugrpo_async.config import Config, save_config
from mugrpo_async.data.pool import load_prompts
from mugrpo_async.reporting.metrics import MetricsSink

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
    tag = uuid.uuid4().hex[:6]  # actor names (dashboard, ray.get_actor) unique per run attempt
    trainers = [
        TrainerRank.options(
            num_cpus=cfg.trainer.cpus_per_rank, num_gpus=cfg.trainer.gpus_per_rank,
            name=f"{cfg.run.name}-trainer-{rank}-{tag}",
        ).remote(d, rank, n, addr, port)
        for rank in range(n)
    ]  # fmt: skip
    workers = [
        RolloutWorker.options(
            num_cpus=cfg.rollout.cpus_per_worker,
            num_gpus=cfg.rollout.gpus_per_worker,
            runtime_env={"env_vars": engine_env(cfg)},
            max_restarts=cfg.rollout.max_restarts,  # a dead worker comes back; the pool re-sends its weights
            max_task_retries=0,  # the pool, not Ray, decides what a restarted worker generates
            name=f"{cfg.run.name}-rollout-{i}-{tag}",
        ).remote(d, i)
        for i in range(cfg.rollout.num_workers)
    ]
    ray.get([w.info.remote() for w in workers] + [t.__ray_ready__.remote() for t in trainers])
    return trainers, workers


class TrainerFailed(RuntimeError):
    """A trainer rank died; the run stops and can be resumed from its newest checkpoint."""


@dataclass
class Run:
    """What both modes share once set up: folder, prompts, actors, metrics sink and checkpoints."""

    cfg: Config
    run_dir: Path
    prompts: list[dict]
    prompts_dropped: int
    trainers: list
    pool: RolloutPool
    sink: MetricsSink
    ckpts: CheckpointStore
    resumed: Resumable
    t0: float
    t_setup: float

    @property
    def workers(self) -> list:
        return self.pool.workers

    @property
    def start_update(self) -> int:
        """Updates already done (restored from the checkpoint)."""
        return self.resumed.update

    def on_trainers(self, method: str, *args) -> list:
        """Call ``method`` on every trainer rank; a dead rank stops the run with how to resume it."""
        return self.collect(self.submit(method, *args), method)

    def submit(self, method: str, *args) -> list:
        """Start ``method`` on every trainer rank (each rank runs its calls in submission order)."""
        return [getattr(t, method).remote(*args) for t in self.trainers]

    def collect(self, refs: list, method: str) -> list:
        """The results of :meth:`submit`; a dead rank stops the run with how to resume it."""
        try:
            return ray.get(refs)
        except RayActorError as err:
            newest = self.ckpts.checkpoints()
            raise TrainerFailed(
                f"a trainer rank died during {method} ({type(err).__name__}); newest checkpoint: "
                f"{newest[-1] if newest else 'none'}. Resume with the same command (run.resume=auto), "
                f"or add --resume"
            ) from None

    def publish(self, packed: list | None = None):
        """The trainer's weights as one object ref (every rank takes part; rank 0's is returned).

        ``packed``: the refs of an ``export_weights`` call already submitted (default: submit one now).
        """
        packed = packed or self.submit("export_weights")
        try:
            ray.wait(packed, num_returns=len(packed))
            ray.get(packed[1:])
        except RayActorError:
            return self.on_trainers("__ray_ready__")  # raises TrainerFailed naming the checkpoint
        return packed[0]

    def checkpoint(self, update: int, extra: dict | None = None, write=None) -> Path:
        """Write and seal the checkpoint after ``update`` updates; ``write(tmp)`` adds mode-specific files."""
        return self.commit_checkpoint(self.begin_checkpoint(update), extra, write)

    def begin_checkpoint(self, update: int) -> tuple[int, Path, list]:
        """Submit the ranks' share of the checkpoint after ``update`` updates (each rank saves before
        any call submitted later); :meth:`commit_checkpoint` seals it."""
        tmp = self.ckpts.begin(update)
        return update, tmp, self.submit("save_state", str(tmp))

    def commit_checkpoint(self, begun: tuple[int, Path, list], extra: dict | None = None, write=None) -> Path:
        """Wait for the ranks' files, add ``write(tmp)``'s, seal with checksums and the metrics line count."""
        update, tmp, saved = begun
        self.collect(saved, "save_state")
        if write is not None:
            write(tmp)
        state = {"update": update, "config_digest": self.cfg.resume_digest(), "mode": self.cfg.schedule.mode,
                 "metrics_lines": self.sink.lines, "t_elapsed_s": time.perf_counter() - self.t0,
                 **(extra or {})}  # fmt: skip
        path = self.ckpts.commit(tmp, state)
        log.info("checkpoint %s", path)
        return path

    def finish(self, summary: dict) -> dict:
        """Save the final HF checkpoint and write the end record (``summary`` plus run totals)."""
        final = self.run_dir / "checkpoints" / "final"
        self.on_trainers("save_hf", str(final))
        summary = {"kind": "end", **summary, "T_setup": self.t_setup, "T_total": time.perf_counter() - self.t0,
                   "prompts_dropped": self.prompts_dropped, "updates": self.cfg.schedule.total_updates,
                   "resumed_from_update": self.start_update, "checkpoint": str(final)}  # fmt: skip
        self.sink.write(summary)
        return summary

    def close(self) -> None:
        self.sink.close()
        for actor in self.trainers + self.workers:
            ray.kill(actor)


def prepare_run(cfg: Config) -> Run:
    """Resume decision, run folder, prompts, Ray, the actors, and the restored checkpoint (both modes)."""
    from transformers import AutoTokenizer

    run_dir = Path(cfg.run.output_dir)
    resumed = find_resumable(run_dir, cfg.run.resume, cfg.resume_digest(), cfg.checkpoint.keep)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    prompts, dropped = load_prompts(cfg, tokenizer)
    t0 = time.perf_counter()
    start_ray(cfg)
    trainers, workers = start_actors(cfg)
    keep = resumed.state["metrics_lines"] if resumed.state else (0 if resumed.found_run else None)
    sink = MetricsSink(run_dir, tensorboard=cfg.logging.tensorboard, keep_lines=keep)
    run = Run(cfg, run_dir, prompts, dropped, trainers, RolloutPool(cfg, workers), sink,
              CheckpointStore(run_dir, cfg.checkpoint.keep), resumed, t0, 0.0)  # fmt: skip
    run.on_trainers("start_clock")
    if resumed.state:
        done = run.on_trainers("load_state", str(resumed.path))
        assert set(done) == {resumed.update}, f"ranks restored different update counts: {done}"
        run.pool.broadcast(run.publish(), resumed.update)
        run.t0 -= resumed.state["t_elapsed_s"]
        log.info("resumed from %s (update %d)", resumed.path, resumed.update)
    if resumed.found_run:
        sink.write({"kind": "resume", "from_update": resumed.update, "checkpoint": str(resumed.path),
                    "skipped_checkpoints": resumed.skipped})  # fmt: skip
    run.t_setup = time.perf_counter() - t0
    return run
