"""What both modes share: Ray, the actors, the run folder, checkpoints, resuming and stopping.

:func:`prepare_run` decides whether the run folder holds a run to continue (``run.resume``), starts
Ray and the actors, and restores the newest valid checkpoint into the trainer ranks and the rollout
workers. :class:`Run` then owns the metrics sink, the due-rules (:class:`Schedule`), checkpoints
(every rank writes its share into one folder, sealed atomically) and the one way an actor's death
stops the run: :meth:`Run.get` and :meth:`Run.collect` turn it into :class:`RunStopped` naming the
actor, and inside :meth:`Run.stopping` any other ``RayActorError`` becomes one too.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.exceptions import RayActorError

from actors.rollout import RolloutWorker, engine_env
from actors.trainer import TrainerRank
from drivers.rollout_pool import RolloutPool
from drivers.stops import NonfiniteUpdates, RunStopped, TrainerFailed, brief
from mugrpo_async.checkpoints.store import CheckpointStore, Resumable, find_resumable
from mugrpo_async.config import Config, save_config
from mugrpo_async.data.pool import load_prompts
from mugrpo_async.reporting.metrics import MetricsSink
from mugrpo_async.training.schedule import NonfiniteStreak, Schedule

log = logging.getLogger(__name__)


def start_ray(cfg: Config) -> None:
    """Connect to the cluster in RAY_ADDRESS (``ray job submit``) or start a local one."""
    if ray.is_initialized():
        return
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.getcwd()}}
    ray_level = logging.INFO if cfg.logging.level == "DEBUG" else logging.ERROR  # Ray's own start-up lines
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=env, log_to_driver=True, logging_level=ray_level)
        return
    ray.init(
        address="local",  # always a fresh local cluster unless RAY_ADDRESS names one
        include_dashboard=cfg.run.dashboard,
        dashboard_host="127.0.0.1",
        runtime_env=env,
        log_to_driver=True,
        logging_level=ray_level,
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


@dataclass
class PendingCheckpoint:
    """A checkpoint begun after ``update``: the ranks' saves are submitted; :meth:`commit` seals it."""

    run: Run
    update: int
    tmp: Path
    saved: list  # the ranks' save_state refs
    files: dict[str, bytes]  # more files (relative to the folder), e.g. the async queue's snapshot
    state: dict  # the run position recorded in state.json

    def commit(self) -> Path:
        """Wait for the ranks' files, add :attr:`files`, seal with checksums (``trainer/state.json``)."""
        self.run.collect(self.saved, "save_state")
        for name, data in self.files.items():
            (self.tmp / name).write_bytes(data)
        path = self.run.ckpts.commit(self.tmp, self.state)
        log.info("checkpoint %s", path)
        return path


@dataclass
class Run:
    """What both modes share once set up: folder, prompts, actors, metrics sink, due-rules and checkpoints."""

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
    sched: Schedule = field(init=False)
    nonfinite: NonfiniteStreak = field(init=False)

    def __post_init__(self) -> None:
        self.sched = Schedule.from_config(self.cfg)
        self.nonfinite = NonfiniteStreak(self.cfg.trainer.max_nonfinite_updates)

    @property
    def workers(self) -> list:
        return self.pool.workers

    @property
    def start_update(self) -> int:
        """Updates already done (restored from the checkpoint)."""
        return self.resumed.update

    def newest_checkpoint(self) -> Path | None:
        """The newest sealed checkpoint (what the same command resumes from)."""
        found = self.ckpts.checkpoints()
        return found[-1] if found else None

    def get(self, refs, what: str, timeout: float | None = None):
        """``ray.get(refs)``; the death of the actor behind them (``what``) stops the run."""
        try:
            return ray.get(refs, timeout=timeout)
        except RayActorError as err:
            raise RunStopped(f"{what} died ({brief(err)})", self.newest_checkpoint()) from None

    @contextmanager
    def stopping(self) -> Iterator[None]:
        """Inside: an actor's death that no call site expected also stops the run as :class:`RunStopped`."""
        try:
            yield
        except RunStopped as err:
            err.checkpoint = err.checkpoint or self.newest_checkpoint()
            raise
        except RayActorError as err:
            raise RunStopped(f"an actor died ({brief(err)})", self.newest_checkpoint()) from None

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
            reason = f"a trainer rank died during {method} ({brief(err)})"
            raise TrainerFailed(reason, self.newest_checkpoint()) from None

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

    def write_update(self, rec: dict, publish: Callable[[], dict] | None = None) -> dict:
        """Write update record ``rec``, counting non-finite updates; ``publish()`` adds its timings to it.

        When ``rec`` makes ``trainer.max_nonfinite_updates`` skipped updates in a row, the record is written
        without publishing and the run stops: nothing is published or checkpointed after the bad updates.
        """
        update = rec["update"]
        stop = self.nonfinite.observe(update, NonfiniteStreak.skipped(rec))
        if publish is not None and not stop:
            rec.update(publish())
        rec["t_wall_s"] = time.perf_counter() - self.t0
        self.sink.write(rec)
        if stop:
            raise NonfiniteUpdates(self.nonfinite.describe(update), self.newest_checkpoint())
        return rec

    def checkpoint(self, update: int, extra: dict | None = None) -> Path:
        """Write and seal the checkpoint after ``update`` updates (nothing in flight)."""
        return self.begin_checkpoint(update, extra).commit()

    def begin_checkpoint(self, update: int, extra: dict | None = None,
                         files: Callable[[], dict[str, bytes]] | None = None) -> PendingCheckpoint:  # fmt: skip
        """Submit the ranks' share of the checkpoint after ``update`` updates (each rank saves before any call
        submitted later); ``files()``, called while they save, gives more files. The run position (metrics
        line count, elapsed time) is taken now."""
        tmp = self.ckpts.begin(update)
        saved = self.submit("save_state", str(tmp))
        more = files() if files is not None else {}
        state = {"update": update, "config_digest": self.cfg.resume_digest(), "mode": self.cfg.schedule.mode,
                 "metrics_lines": self.sink.lines, "t_elapsed_s": time.perf_counter() - self.t0,
                 **(extra or {})}  # fmt: skip
        return PendingCheckpoint(self, update, tmp, saved, more, state)

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
