"""The asynchronous pipeline: rollout workers and trainer ranks run at the same time.

Rollout workers loop (``RolloutWorker.run_async``): newest weights -> reserve -> generate -> put. The
driver serves the trainer: per update it gets B_mini groups from the :class:`SampleQueue` (blocking,
with a timeout), hands the same minibatch to every rank (update u+1 and its minibatch are on their way
while update u runs, except before an evaluation or a checkpoint, whose queue snapshot must hold every
unserved group), and every ``sync_every`` updates publishes
the weights once (one object ref per version) on the queue's weights board. The staleness cap mu is
the queue's: admission control first, counted drops as the backstop.

Faults and resuming: every group put is on disk (``rollouts/async/``) before it can be served; a
checkpoint holds the queue's snapshot; a resumed run queues the snapshot's groups plus everything put
after it. A rollout worker whose loop dies is restarted by Ray; its unfinished reservations are
released and its loop starts again where its prompt stream stood.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
from ray.exceptions import RayActorError
from tqdm import tqdm

from actors.sample_queue import SampleQueue
from drivers.periodic_eval import PeriodicEval
from drivers.rollout_pool import RolloutFailed
from drivers.run import Run, prepare_run
from mugrpo_async.config import Config
from mugrpo_async.reporting.metrics import read_metrics, update_record

log = logging.getLogger(__name__)


def _publish(run: Run, queue, version: int, exports: list | None = None) -> float:
    """Put version ``version`` on the queue's weights board (``exports``: refs of a submitted export)."""
    t0 = time.perf_counter()
    ref = run.publish(exports)
    run.pool.weights = (version, ref)  # what a restarted worker is given
    ray.get(queue.publish.remote(version, [ref]))
    return time.perf_counter() - t0


class _Checkpoint:
    """A checkpoint begun after an update: queue snapshot taken, ranks' saves submitted; sealed later.

    The ranks save while the queue snapshots (taken with nothing fetched ahead, so it holds every
    unserved group); the next update may then be submitted (each rank saves first) before the files
    are checked and sealed.
    """

    def __init__(self, run: Run, queue, update: int):
        self.run, self.begun = run, run.begin_checkpoint(update)
        self.snap = ray.get(queue.snapshot.remote())

    def commit(self) -> None:
        snap = self.snap

        def write(tmp):
            (tmp / "trainer" / "queue.msgpack").write_bytes(snap["queued"])
            (tmp / "trainer" / "queue.json").write_text(json.dumps({k: v for k, v in snap.items() if k != "queued"}))

        self.run.commit_checkpoint(self.begun, write=write)


def _restore_queue(run: Run, queue) -> dict[int, int]:
    """Queue what the checkpoint held plus what was put after it; groups put per worker."""
    snap = None
    if run.resumed.state:
        folder = run.resumed.path / "trainer"
        snap = {**json.loads((folder / "queue.json").read_text()), "queued": (folder / "queue.msgpack").read_bytes()}
    per_worker = ray.get(queue.restore.remote(snap))
    if run.pool.weights is not None:
        ray.get(queue.publish.remote(run.pool.weights[0], [run.pool.weights[1]]))
    return per_worker


class _Loops:
    """The workers' generation loops; a loop whose worker died is restarted where it stood."""

    def __init__(self, run: Run, queue, cursors: dict[int, int]):
        self.run, self.queue = run, queue
        self.refs = {self._start(i, cursors.get(i, 0)): i for i in range(len(run.workers))}
        self.restarts = 0

    def _start(self, i: int, cursor: int):
        return self.run.workers[i].run_async.remote(self.queue, self.run.prompts, self.run.cfg.rollout.batch_groups,
                                                    cursor)  # fmt: skip

    def check(self) -> None:
        done, _ = ray.wait(list(self.refs), num_returns=len(self.refs), timeout=0)
        for ref in done:
            i = self.refs.pop(ref)
            try:
                ray.get(ref)
                continue  # a loop ends only after stop
            except RayActorError as err:
                log.warning("rollout worker %d died (%s); restarting its loop", i, type(err).__name__)
            lost = ray.get(self.queue.release_worker.remote(i))
            if not self.run.pool.heal(self.run.workers[i]):
                raise RolloutFailed(f"rollout worker {i} died and could not be restarted") from None
            self.restarts += 1
            cursor = ray.get(self.queue.put_by.remote(i))
            log.info("worker %d: released %d reservations, continues at prompt %d", i, lost, cursor)
            self.refs[self._start(i, cursor)] = i

    def finish(self) -> list:
        return ray.get(list(self.refs))


class _AsyncEval:
    """Evaluations handed to the rollout workers through the queue; results recorded as they come."""

    def __init__(self, run: Run, queue):
        self.peval, self.run, self.queue = PeriodicEval(run), run, queue
        self.pending: dict[int, Path] = {}  # update -> candidate folder

    def request(self, update: int) -> None:
        self.pending[update] = self.peval.save_candidate(update)
        request = {"update": update, "weights": [self.run.publish()], "benchmarks": self.peval.requests()}
        ray.get(self.queue.request_eval.remote(request))

    def collect(self, wait_s: float = 0.0) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            for update, records, t_eval in ray.get(self.queue.eval_results.remote()):
                self.peval.record(update, records, t_eval, self.pending.pop(update))
            if not self.pending or time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def final(self, total: int) -> None:
        """After the loops stopped: wait for requested results, then evaluate the final policy if not yet."""
        if self.peval.enabled and self.peval.last != total and total not in self.pending:
            worker = self.run.workers[0]
            ray.get(worker.update_weights.remote(self.run.publish()))
            self.peval.evaluate_now(total, worker)


@dataclass
class _Step:
    """One update submitted to the trainer ranks and not yet recorded."""

    update: int  # 0-based
    refs: list  # update_groups, one ref per rank
    groups: list
    exports: list | None = None  # export_weights right after it, when a publish is due


def train_async(run: Run, queue) -> dict:
    """The update loop from wherever the run stands; returns the run totals for the end record.

    The trainer ranks never wait for the driver: update u+1 (and its minibatch) is submitted before
    update u's record is written, and the weights of a due publish are exported right behind their
    update, in each rank's call order. Before an evaluation or a checkpoint nothing is in flight, and a
    checkpoint is sealed (the ranks' files checked, checksums written) while the next update runs.
    """
    cfg, s = run.cfg, run.cfg.schedule
    loops = _Loops(run, queue, _restore_queue(run, queue))
    evals = _AsyncEval(run, queue)
    t_sync_total = 0.0
    off, every = not cfg.logging.progress, cfg.checkpoint_interval
    gen_bar = tqdm(desc="async rollout (groups)", unit="group", position=1, disable=off)
    bar = tqdm(range(run.start_update, s.total_updates), desc="async train", unit="update", position=0, disable=off)

    def record(step: _Step) -> dict:
        nonlocal t_sync_total
        u = step.update
        rec = update_record(run.collect(step.refs, "update_groups"), update=u + 1,
                            policy_version=u - u % s.sync_every)  # fmt: skip
        if step.exports is not None:
            rec["t_weight_sync_s"] = _publish(run, queue, u + 1, step.exports)
            t_sync_total += rec["t_weight_sync_s"]
        stats = ray.get(queue.stats.remote())
        gen_bar.update(stats["put"] - gen_bar.n)
        rec.update(queue_depth=stats["queue_depth"], dropped=stats["dropped"], t_wall_s=time.perf_counter() - run.t0,
                   group_uids=[g.meta.get("uid") for g in step.groups])  # fmt: skip
        run.sink.write(rec)
        evals.collect()
        return rec

    rec: dict = {}
    inflight: _Step | None = None
    ckpt: _Checkpoint | None = None
    pending = queue.get.remote(run.start_update, s.get_timeout_s)
    for u in bar:
        loops.check()
        groups = ray.get(pending)
        if groups is None:
            raise RolloutFailed(
                f"no minibatch within schedule.get_timeout_s={s.get_timeout_s}s at update {u + 1}: rollout workers "
                "stalled; resume with the same command once they are healthy"
            )
        eval_due = evals.peval.due(u + 1) or (u + 1 == s.total_updates and evals.peval.enabled)
        ckpt_due = (u + 1) % every == 0 or u + 1 == s.total_updates
        if not (eval_due or ckpt_due):  # the next minibatch arrives while this update runs
            pending = queue.get.remote(u + 1, s.get_timeout_s)
        step = _Step(u, run.submit("update_groups", ray.put(groups)), groups)
        if (u + 1) % s.sync_every == 0:
            step.exports = run.submit("export_weights")
        if inflight is not None:
            rec = record(inflight)
        if ckpt is not None:  # sealed while this update runs
            ckpt.commit()
            ckpt = None
        inflight = step
        if eval_due or ckpt_due:
            rec, inflight = record(step), None
            if eval_due:
                evals.request(u + 1)
            if ckpt_due:
                ckpt = _Checkpoint(run, queue, u + 1)
            if u + 1 < s.total_updates:
                pending = queue.get.remote(u + 1, s.get_timeout_s)
    if inflight is not None:
        rec = record(inflight)
    if ckpt is not None:
        ckpt.commit()
    evals.collect(wait_s=s.get_timeout_s)  # the workers still loop, so requested evaluations finish
    ray.get(queue.stop.remote())
    worker_stats = loops.finish()
    evals.final(s.total_updates)
    gen_bar.close()
    stats = ray.get(queue.stats.remote())
    rewards = [r["reward_mean"] for r in read_metrics(run.run_dir, "update")]
    return {
        "T_weight_sync": t_sync_total, "trainer_idle_ratio": rec.get("trainer_idle_ratio", 0.0),
        "reward_first_quarter": float(np.mean(rewards[: max(1, len(rewards) // 4)])) if rewards else 0.0,
        "reward_last_quarter": float(np.mean(rewards[-max(1, len(rewards) // 4) :])) if rewards else 0.0,
        "generated": stats["put"], "served": stats["served"], "dropped": stats["dropped"],
        "left_in_queue": stats["queue_depth"], "workers": worker_stats, "worker_restarts": loops.restarts,
    }  # fmt: skip


def run_async(cfg: Config) -> dict:
    """The whole asynchronous run (continuing a run found in the folder); returns the end-of-run summary."""
    run = prepare_run(cfg)
    s = cfg.schedule
    queue = SampleQueue.remote(s.mu, s.groups_per_update, s.queue_capacity, cfg.run.name,
                               str(run.run_dir / "rollouts" / "async"), cfg.resume_digest())  # fmt: skip
    try:
        totals = train_async(run, queue)
        log.info(
            "async: %d updates, idle ratio %.3f, generated %d, served %d, dropped %d, left %d",
            s.total_updates, totals["trainer_idle_ratio"], totals["generated"], totals["served"],
            totals["dropped"], totals["left_in_queue"],
        )  # fmt: skip
        return run.finish(totals)
    finally:
        run.close()
        ray.kill(queue)
