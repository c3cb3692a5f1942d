"""The asynchronous pipeline: rollout workers and trainer ranks run at the same time.

Rollout workers loop (``RolloutWorker.run_async``): newest weights -> reserve -> generate -> put. The
driver serves the trainer: per update it gets B_mini groups from the :class:`SampleQueue` (blocking,
with a timeout) and hands the same minibatch to every rank; update U+1 and its minibatch are on their
way while update U runs (:mod:`drivers.pipeline`), except before an evaluation or a checkpoint, whose
queue snapshot must hold every unserved group. Every ``sync_every`` updates the weights are published
once (one object ref per version) on the queue's weights board. The staleness cap mu is the queue's:
admission control first, counted drops as the backstop. With ``rollout.dynamic_sampling`` the queue filters
equal-reward groups (``groups_filtered``, ``groups_short`` in the update and end records). When to publish,
evaluate and checkpoint is :class:`~mugrpo_async.training.schedule.Schedule`'s rule, the same as in sync mode.

Faults and resuming: every group put is on disk (``rollouts/async/``) before it can be served; a
checkpoint holds the queue's snapshot; a resumed run queues the snapshot's groups plus everything put
after it. A rollout worker whose process dies is restarted by Ray, and one whose engine stalls while it
generates or evaluates (no token and no finished group for ``rollout.stall_timeout_s``,
:class:`~drivers.rollout_pool.Watched`) is killed to be restarted the same way; its unfinished reservations
(and an evaluation it had taken) are given back and its loop starts again where its prompt stream stood.
``schedule.get_timeout_s`` stays the backstop for everything else (a worker stuck outside its engine). A
worker past its restarts, a loop that raised, and the death of the queue stop the run
(:class:`~drivers.stops.RunStopped`: exit 3, the newest checkpoint, the command that resumes).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import ray
from ray.exceptions import RayActorError, RayTaskError
from tqdm import tqdm

from actors.sample_queue import SampleQueue
from drivers.periodic_eval import PeriodicEval
from drivers.pipeline import Step, UpdatePipeline
from drivers.rollout_pool import Watched
from drivers.run import Run, prepare_run
from drivers.stops import RolloutFailed, brief
from mugrpo_async.config import Config
from mugrpo_async.reporting.metrics import read_metrics, update_record
from mugrpo_async.reporting.plan import async_lag_bound

log = logging.getLogger(__name__)


class _Queue:
    """The sample queue actor's calls as the driver makes them: its death stops the run."""

    def __init__(self, run: Run, actor):
        self.run, self.actor = run, actor

    def call(self, method: str, *args):
        return self.run.get(self.remote(method, *args), "the sample queue actor")

    def remote(self, method: str, *args):
        return getattr(self.actor, method).remote(*args)


def _publish(run: Run, queue: _Queue, version: int, pending: list) -> dict:
    """Put version ``version`` on the queue's weights board (``pending``: the refs of ``run.start_publish``).

    Returns the record's timings: ``t_weight_sync_s``, the driver's wait for the weights to be in the object
    store (the trainer runs its next update meanwhile), ``t_publish_pack_s``, the trainer's time on its update
    path (rank 0's pack between two updates), and ``t_publish_store_s``, rank 0's copy into the object store
    beside the next update."""
    t0 = time.perf_counter()
    ref, packed = run.publish_timed(pending)
    run.pool.weights = (version, ref)  # what a restarted worker is given
    queue.call("publish", version, [ref])
    return {"t_weight_sync_s": time.perf_counter() - t0, "t_publish_pack_s": packed["t_pack_s"],
            "t_publish_store_s": packed["t_store_s"]}  # fmt: skip


def _queue_files(snap: dict) -> dict[str, bytes]:
    """A queue snapshot as checkpoint files: the counters and the queued groups' refs (JSON), or the queued groups
    themselves (msgpack) when the queue has no store."""
    meta = {k: v for k, v in snap.items() if k != "queued"}
    groups = {"trainer/queue.msgpack": snap["queued"]} if "queued" in snap else {}
    return {**groups, "trainer/queue.json": json.dumps(meta).encode()}


def _restore_queue(run: Run, queue: _Queue) -> dict[int, int]:
    """Queue what the checkpoint held plus what was put after it; groups put per worker."""
    snap = None
    if run.resumed.state:
        folder = run.resumed.path / "trainer"
        snap = json.loads((folder / "queue.json").read_text())
        if (folder / "queue.msgpack").is_file():
            snap["queued"] = (folder / "queue.msgpack").read_bytes()
    per_worker = queue.call("restore", snap)
    if run.pool.weights is not None:
        queue.call("publish", run.pool.weights[0], [run.pool.weights[1]])
    return per_worker


class _Loops:
    """The workers' generation loops (streaming calls); a loop whose worker died or stalled is restarted where it
    stood."""

    def __init__(self, run: Run, queue: _Queue, cursors: dict[int, int]):
        self.run, self.queue = run, queue
        infos = run.get([w.info.remote() for w in run.workers], "a rollout worker")
        self.index = {id(w): info["index"] for w, info in zip(run.workers, infos)}  # the worker's own number
        self.loops, self.totals = Watched(run.cfg.rollout.stall_timeout_s), []
        for w in run.workers:
            self._start(w, cursors.get(self.index[id(w)], 0))
        self.restarts = 0

    def _start(self, worker, cursor: int) -> None:
        args = (self.queue.actor, self.run.prompts, self.run.cfg.rollout.batch_groups, cursor)
        i = self.index[id(worker)]  # a loop is watched from its first busy report (its engine at work)
        self.loops.add(worker.run_async.remote(*args), worker, i, f"rollout worker {i}", busy=False)

    def minibatch(self, pending, update: int) -> list:
        """The groups of ``pending`` (a queue ``get``), tending the loops while it waits."""
        while not ray.wait([pending], timeout=0)[0]:
            self.loops.wait((pending,))
            self.check()
        groups = self.run.get(pending, "the sample queue actor")
        if groups is None:
            s = self.run.cfg.schedule
            raise RolloutFailed(f"no minibatch for update {update} within schedule.get_timeout_s={s.get_timeout_s}s: "
                                "the rollout workers stalled")  # fmt: skip
        return groups

    def check(self) -> None:
        """Restart the loop of a worker that died or stalled; a loop that raised, or a dead queue, stops the run."""
        self.loops.kill_stalled()  # a killed worker's loop ends as a death, handled below
        for stream in self.loops.ready():
            worker = self.loops.pending[stream].worker
            i = self.index[id(worker)]
            try:
                item = self.loops.take(stream)
                if item is not None:  # a loop ends only after stop
                    self.totals.append(item["result"])
                continue  # else a progress report
            except RayTaskError as err:  # the loop raised: the worker lives; a dead queue fails every call
                self.queue.call("is_stopped")  # the queue's death stops the run here, naming the queue
                raise RolloutFailed(f"rollout worker {i}'s generation loop failed ({brief(err)})") from None
            except RayActorError as err:
                log.warning("rollout worker %d died (%s); restarting its loop", i, type(err).__name__)
            lost = self.queue.call("release_worker", i)
            if not self.run.pool.heal(worker):
                raise RolloutFailed(f"rollout worker {i} died and was not restarted "
                                    f"(rollout.max_restarts={self.run.cfg.rollout.max_restarts})")  # fmt: skip
            self.restarts += 1
            cursor = self.queue.call("put_by", i)
            log.info("worker %d: released %d reservations, continues at prompt %d", i, lost, cursor)
            self._start(worker, cursor)

    def finish(self) -> list:
        """After the queue says stop: each loop's totals."""
        while self.loops.pending:
            self.loops.wait()
            self.check()
        return sorted(self.totals, key=lambda t: t["worker"])


class _AsyncEval:
    """Evaluations handed to the rollout workers through the queue; results recorded as they come."""

    def __init__(self, run: Run, queue: _Queue):
        self.peval, self.run, self.queue = PeriodicEval(run), run, queue
        self.pending: dict[int, Path] = {}  # update -> candidate folder

    def request(self, update: int) -> None:
        self.pending[update] = self.peval.save_candidate(update)
        request = {"update": update, "weights": [self.run.publish()], "benchmarks": self.peval.requests()}
        self.queue.call("request_eval", request)

    def collect(self) -> None:
        for update, records, t_eval in self.queue.call("eval_results"):
            if update in self.pending:  # an evaluation given back by a dead worker may come twice
                self.peval.record(update, records, t_eval, self.pending.pop(update))

    def wait(self, loops: _Loops, wait_s: float) -> None:
        """Collect the requested evaluations while the workers still loop (at most ``wait_s``)."""
        deadline = time.monotonic() + wait_s
        self.collect()
        while self.pending and time.monotonic() < deadline:
            loops.check()
            time.sleep(0.1)
            self.collect()
        for update, candidate in self.pending.items():
            log.warning("the evaluation of update %d did not finish within %.0fs; left out", update, wait_s)
            self.peval.drop_candidate(candidate)


def train_async(run: Run, queue: _Queue) -> dict:
    """The update loop from wherever the run stands; returns the run totals for the end record."""
    cfg, sched, timeout = run.cfg, run.sched, run.cfg.schedule.get_timeout_s
    loops = _Loops(run, queue, _restore_queue(run, queue))
    evals = _AsyncEval(run, queue)
    off = not cfg.logging.progress
    bar = tqdm(total=sched.total_updates, initial=run.start_update, desc="async train", unit="update", disable=off)
    gen_bar = tqdm(desc="async rollout (groups)", unit="group", position=1, disable=off)

    def record(step: Step) -> dict:
        rec = update_record(run.collect(step.refs, "update_groups"), update=step.update,
                            policy_version=sched.policy_version(step.update))  # fmt: skip
        stats = queue.call("stats")
        gen_bar.update(stats["put"] - gen_bar.n)
        run.status.set_queue(stats)
        rec.update(queue_depth=stats["queue_depth"], dropped=stats["dropped"],
                   group_uids=[g.meta.get("uid") for g in step.groups])  # fmt: skip
        if cfg.rollout.dynamic_sampling:
            rec.update(groups_filtered=stats["groups_filtered"], groups_short=stats["groups_short"])
        publish = (lambda: _publish(run, queue, step.update, step.exports)) if step.exports else None
        run.write_update(rec, publish)
        evals.collect()
        bar.update()
        return rec

    pipe = UpdatePipeline(record)
    todo = sched.updates(run.start_update)
    pending = queue.remote("get", todo.start - 1, timeout) if todo else None  # get counts updates from 0
    for U in todo:
        groups = loops.minibatch(pending, U)
        due = sched.after(U)
        if not due.barrier:  # the next minibatch arrives while this update runs
            pending = queue.remote("get", U, timeout)
        step = Step(U, run.submit("update_groups", ray.put(groups)), groups)
        if due.publish:
            step.exports = run.start_publish()  # packed right behind its update, stored during the next
        pipe.push(step)
        if due.barrier:
            pipe.drain()  # nothing in flight: update U's weights, every unserved group in the queue
            if due.evaluate:
                evals.request(U)
            if due.checkpoint:  # the queue's snapshot is taken while the ranks save; sealed during update U+1
                ckpt = run.begin_checkpoint(U, files=lambda: _queue_files(queue.call("snapshot")))
                pipe.seal_after_next(ckpt.commit)
            if U < sched.total_updates:
                pending = queue.remote("get", U, timeout)
    pipe.close()
    bar.close()
    evals.wait(loops, timeout)  # the workers still loop, so requested evaluations finish
    queue.call("stop")
    worker_stats = loops.finish()
    gen_bar.close()
    evals.peval.evaluate_final(worker_holds_final=False)
    stats = queue.call("stats")
    run.status.set_queue(stats)  # the final status line counts what the end record counts
    return _totals(run, stats, pipe.last or {}, worker_stats, loops.restarts)


def _totals(run: Run, stats: dict, last: dict, workers: list, restarts: int) -> dict:
    """The async part of the end record: reward trend, weight sync time and the conservation of groups."""
    updates = read_metrics(run.run_dir, "update")
    rewards = [r["reward_mean"] for r in updates]
    quarter = max(1, len(rewards) // 4)
    return {
        "T_weight_sync": sum(r.get("t_weight_sync_s", 0.0) for r in updates),
        "trainer_idle_ratio": last.get("trainer_idle_ratio", updates[-1]["trainer_idle_ratio"] if updates else 0.0),
        "reward_first_quarter": float(np.mean(rewards[:quarter])) if rewards else 0.0,
        "reward_last_quarter": float(np.mean(rewards[-quarter:])) if rewards else 0.0,
        "generated": stats["put"], "served": stats["served"], "dropped": stats["dropped"],
        "groups_filtered": stats["groups_filtered"], "groups_short": stats["groups_short"],
        "blocked_lag": stats["blocked_lag"], "blocked_room": stats["blocked_room"],
        "engine_occupancy": _mean_occupancy(workers),
        "left_in_queue": stats["queue_depth"], "workers": workers, "worker_restarts": restarts,
    }  # fmt: skip


def _mean_occupancy(workers: list[dict]) -> float:
    """The workers' engine occupancy (each over its loop's wall time), averaged over the workers."""
    values = [w["engine_occupancy"] for w in workers if "engine_occupancy" in w]
    return float(np.mean(values)) if values else 0.0


def run_async(cfg: Config) -> dict:
    """The whole asynchronous run (continuing a run found in the folder); returns the end-of-run summary."""
    run = prepare_run(cfg)
    s, refill = cfg.schedule, cfg.rollout.max_refill_rounds if cfg.rollout.dynamic_sampling else None
    log.info("async: %s", async_lag_bound(cfg))
    actor = SampleQueue.remote(s.mu, s.groups_per_update, s.queue_capacity, cfg.run.name,
                               str(run.run_dir / "rollouts" / "async"), cfg.resume_digest(), refill)  # fmt: skip
    try:
        with run.stopping():
            totals = train_async(run, _Queue(run, actor))
            log.info(
                "async: %d updates, idle ratio %.3f, generated %d, served %d, dropped %d, left %d",
                s.total_updates, totals["trainer_idle_ratio"], totals["generated"], totals["served"],
                totals["dropped"], totals["left_in_queue"],
            )  # fmt: skip
            return run.finish(totals)
    finally:
        run.close()
        ray.kill(actor)
