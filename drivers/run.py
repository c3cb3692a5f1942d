"""What both modes share: Ray, the actors, the run folder, checkpoints, resuming and stopping.

:func:`prepare_run` decides whether the run folder holds a run to continue (``run.resume``), starts
Ray and the actors, and restores the newest valid checkpoint into the trainer ranks and the rollout
workers. Every actor's bundles are reserved first, in one placement group pinned to the nodes
:mod:`mugrpo_async.placement` plans (:mod:`drivers.cluster`), and every node hosting an actor must see the
run folder. :class:`Run` then owns the metrics sink, the due-rules (:class:`Schedule`), checkpoints
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

from actors.rollout import RolloutWorker
from drivers.cluster import Reservation, ResourceError, check_run_folder, live_nodes, reserve
from drivers.rollout_pool import RolloutPool
from drivers.stops import NonfiniteUpdates, RunStopped, TrainerFailed, brief
from drivers.trainer_group import start_trainer_group
from mugrpo_async.checkpoints.store import CheckpointStore, Resumable, find_resumable
from mugrpo_async.config import Config, save_config
from mugrpo_async.data.pool import load_prompts
from mugrpo_async.placement import Placement, PlacementError, plan_placement
from mugrpo_async.reporting.metrics import MetricsSink, wandb_settings
from mugrpo_async.reporting.plan import format_placement
from mugrpo_async.reporting.status import RunStatus, StatusBoard
from mugrpo_async.rollout.engine import engine_env, tensor_parallel_env
from mugrpo_async.training.schedule import NonfiniteStreak, Schedule
from mugrpo_async.weight_sync.coordinator import WeightSync, make_weight_sync

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


def check_resources(cfg: Config) -> Placement:
    """Where every actor goes on the connected cluster's nodes; fail fast, naming the keys, when they do not fit.

    Every actor reserves its ``cpus_per_*`` / ``gpus_per_*`` (see :mod:`mugrpo_async.placement`); Ray never
    places more than a node has, so an over-large request would wait forever instead of oversubscribing.
    Reward scorers and the async queue reserve nothing (they run on their callers' reservations).
    """
    try:
        return plan_placement(cfg, live_nodes())
    except PlacementError as err:
        raise ResourceError(str(err)) from None


def actor_options(cfg: Config, reservation: Reservation, tag: str) -> tuple[list[dict], list[dict]]:
    """The Ray ``.options(...)`` of each trainer rank (rank order) and each rollout worker, in their bundles.

    A tensor-parallel engine's worker holds only CPUs in its first bundle: its vLLM workers take the GPUs of all
    its bundles (:func:`~mugrpo_async.rollout.engine.tensor_parallel_env`).
    """
    r, t, plan = cfg.rollout, cfg.trainer, reservation.placement
    trainers = [dict(num_cpus=t.cpus_per_rank, num_gpus=t.gpus_per_rank, name=f"{cfg.run.name}-trainer-{s.index}-{tag}",
                     scheduling_strategy=reservation.strategy(s.bundles[0])) for s in plan.trainers]  # fmt: skip
    workers = []
    for s in plan.engines:
        env = engine_env(cfg)
        if r.tensor_parallel_size > 1:
            env.update(tensor_parallel_env(list(s.bundles), r.gpus_per_worker))
        workers.append(dict(
            num_cpus=r.cpus_per_worker,
            num_gpus=r.gpus_per_worker if r.tensor_parallel_size == 1 else 0,
            runtime_env={"env_vars": env},
            max_restarts=r.max_restarts,  # a dead worker comes back (in its bundle); the pool re-sends its weights
            max_task_retries=0,  # the pool, not Ray, decides what a restarted worker generates
            name=f"{cfg.run.name}-rollout-{s.index}-{tag}",
            scheduling_strategy=reservation.strategy(s.bundles[0]),
        ))  # fmt: skip
    return trainers, workers


def start_actors(cfg: Config, reservation: Reservation) -> tuple[list, list]:
    """Create the trainer ranks and rollout workers in their reserved bundles and wait until all are ready."""
    d = cfg.to_dict()
    tag = uuid.uuid4().hex[:6]  # actor names (dashboard, ray.get_actor) unique per run attempt
    trainer_options, worker_options = actor_options(cfg, reservation, tag)
    workers = [RolloutWorker.options(**opts).remote(d, i) for i, opts in enumerate(worker_options)]
    trainers = start_trainer_group(cfg, trainer_options)  # the workers start meanwhile
    ray.get([w.info.remote() for w in workers])
    return trainers, workers


def resolve_run_folder(cfg: Config) -> list[str]:
    """Make ``run.output_dir`` absolute, resolved once on the driver (under Ray Jobs a relative path would resolve
    in each node's own copy of the working dir); returns a note for the saved config when it was relative."""
    given = Path(cfg.run.output_dir)
    if given.is_absolute():
        return []
    cfg.run.output_dir = str(given.resolve())
    return [f"run.output_dir: {given} resolved on the driver (in {Path.cwd()}) to {cfg.run.output_dir}"]


def set_up_cluster(cfg: Config, run_dir: Path) -> Reservation:
    """Plan on the live nodes, check that the nodes it uses see the run folder, then reserve every actor's bundles
    (all or nothing)."""
    placement = check_resources(cfg)
    for line in format_placement(placement, cfg).splitlines():
        log.info("%s", line)
    check_run_folder(run_dir, placement, cfg.placement.timeout_s)
    return reserve(placement, f"{cfg.run.name}-{uuid.uuid4().hex[:6]}", cfg.placement.timeout_s)


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
    reservation: Reservation | None = None  # the bundles the actors run in (released by close)
    status: StatusBoard | None = None  # the live status line and status.json (prepare_run starts it)
    sched: Schedule = field(init=False)
    nonfinite: NonfiniteStreak = field(init=False)
    weights: WeightSync = field(init=False)  # weight_sync.backend: broadcast(version) to every engine

    def __post_init__(self) -> None:
        self.sched = Schedule.from_config(self.cfg)
        self.nonfinite = NonfiniteStreak(self.cfg.trainer.max_nonfinite_updates)
        self.weights = make_weight_sync(self)

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

    def start_publish(self) -> list:
        """Submit a publish of the trainer's current weights: every rank packs them right behind the calls already
        submitted (``pack_weights``), then rank 0 copies them into the object store in its publish thread
        (``take_weights``) while its next calls run. Returns the refs for :meth:`publish`."""
        return [*self.submit("pack_weights"), self.trainers[0].take_weights.remote()]

    def publish(self, pending: list | None = None):
        """The trainer's weights as one object ref (``pending``: the refs of :meth:`start_publish`, default: a
        publish submitted now)."""
        return self.publish_timed(pending)[0]

    def publish_timed(self, pending: list | None = None) -> tuple:
        """(:meth:`publish`'s ref, rank 0's record of it: ``version``, ``nbytes``, ``t_pack_s``, the seconds on the
        trainer's update path, and ``t_store_s``, the copy into the object store that ran beside the next update)."""
        pending = pending or self.start_publish()
        try:
            packed, *_, (ref, t_store) = ray.get(pending)
        except RayActorError:
            return self.on_trainers("__ray_ready__")  # raises TrainerFailed naming the checkpoint
        return ref, packed | {"t_store_s": t_store}

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
        if self.status is not None:
            self.status.observe_update(rec)
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
        if self.status is not None:
            self.status.stop("finished")
        return summary

    def close(self) -> None:
        if self.status is not None:
            self.status.stop("stopped")  # nothing when finish() already stopped it
        self.sink.close()
        for actor in self.trainers + self.workers:
            ray.kill(actor)
        if self.reservation is not None:
            self.reservation.release()


def prepare_run(cfg: Config) -> Run:
    """Resume decision, run folder, prompts, Ray, the reserved bundles, the actors, and the restored checkpoint
    (both modes). A relative ``run.output_dir`` becomes absolute here (:func:`resolve_run_folder`)."""
    from transformers import AutoTokenizer

    notes = resolve_run_folder(cfg)
    run_dir = Path(cfg.run.output_dir)
    resumed = find_resumable(run_dir, cfg.run.resume, cfg.resume_digest(), cfg.checkpoint.keep)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml", notes)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    prompts, dropped = load_prompts(cfg, tokenizer)
    t0 = time.perf_counter()
    start_ray(cfg)
    reservation = set_up_cluster(cfg, run_dir)
    try:
        trainers, workers = start_actors(cfg, reservation)
    except BaseException:
        reservation.release()
        raise
    keep = resumed.state["metrics_lines"] if resumed.state else (0 if resumed.found_run else None)
    sink = MetricsSink(run_dir, tensorboard=cfg.logging.tensorboard, keep_lines=keep, wandb=wandb_settings(cfg))
    run = Run(cfg, run_dir, prompts, dropped, trainers, RolloutPool(cfg, workers), sink,
              CheckpointStore(run_dir, cfg.checkpoint.keep), resumed, t0, 0.0, reservation)  # fmt: skip
    run.on_trainers("start_clock")
    if resumed.state:
        done = run.on_trainers("load_state", str(resumed.path))
        assert set(done) == {resumed.update}, f"ranks restored different update counts: {done}"
        run.weights.broadcast(resumed.update)
        run.t0 -= resumed.state["t_elapsed_s"]
        log.info("resumed from %s (update %d)", resumed.path, resumed.update)
    if resumed.found_run:
        sink.write({"kind": "resume", "from_update": resumed.update, "checkpoint": str(resumed.path),
                    "skipped_checkpoints": resumed.skipped})  # fmt: skip
    run.t_setup = time.perf_counter() - t0
    run.status = _status_board(run)
    return run


def _status_board(run: Run) -> StatusBoard:
    """The run's live status (:mod:`mugrpo_async.reporting.status`), ticking: a log line and status.json every
    ``logging.status_every_s`` seconds; the driver's gauges follow it."""
    from actors.gauges import driver_gauges

    c, s = run.cfg, run.cfg.schedule
    status = RunStatus(run=c.run.name, mode=s.mode, total_updates=s.total_updates,
                       groups_per_update=s.groups_per_update, updates=run.start_update)  # fmt: skip
    board = StatusBoard(status, run.run_dir, c.logging.status_every_s, lambda line: log.info("status: %s", line),
                        lambda: time.perf_counter() - run.t0, driver_gauges(c.run.name))  # fmt: skip
    board.start()
    return board
