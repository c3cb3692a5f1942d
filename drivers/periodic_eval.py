"""Evaluation during training: every ``eval.every_updates`` updates and at the end, the best policy kept.

Each evaluation writes one ``eval`` record to metrics.jsonl::

    {"kind": "eval", "update": U, "policy_version": U, "eval/<benchmark>": pass@1, ..., "eval/mean": mean,
     "benchmarks": {<benchmark>: summary}, "t_eval_s": ..., "t_wall_s": ..., "best": true|false}

and, when ``eval/mean`` is the best so far, the evaluated policy becomes ``checkpoints/best/`` (an HF
folder). Sync mode evaluates on rollout worker 0 between training phases (the trainer then holds the
evaluated weights). Async mode hands the worker a request through the sample queue, so the worker
evaluates between two generation batches while training goes on; the policy of update U is saved as a
candidate folder when the request is made and becomes ``best`` (or is removed) when the result arrives.
When evaluations are due is :class:`~mugrpo_async.training.schedule.Schedule`'s rule; the final policy
is evaluated after the update loop, in both modes by :meth:`PeriodicEval.evaluate_final`. A worker that
dies while it evaluates stops the run (:class:`~drivers.stops.RunStopped`).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from drivers.run import Run
from mugrpo_async.checkpoints.model_folder import atomic_replace_dir
from mugrpo_async.reporting.metrics import read_metrics

log = logging.getLogger(__name__)


class PeriodicEval:
    """The run's evaluation schedule, prompts (tokenised once) and best score."""

    def __init__(self, run: Run):
        from transformers import AutoTokenizer

        from mugrpo_async.evaluation.benchmarks import eval_plan, load_benchmark

        self.run, cfg = run, run.cfg
        self.enabled = run.sched.eval_enabled
        self.work: dict[str, tuple[list[dict], int, object]] = {}
        if self.enabled:
            tok = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
            for name in cfg.eval.benchmarks:
                prompts, dropped = load_benchmark(name, cfg, tok)
                self.work[name] = (prompts, dropped, eval_plan(cfg, name))
        earlier = read_metrics(run.run_dir, "eval")  # a resumed run keeps its best and knows what it evaluated
        self.best = max((r["eval/mean"] for r in earlier if r.get("eval/mean") is not None), default=float("-inf"))
        self.last = max((r["update"] for r in earlier), default=-1)  # update of the newest evaluation

    def requests(self) -> dict:
        """Per benchmark: the prompts and how to sample them (what a worker's ``evaluate`` takes)."""
        return {name: {"prompts": p, "n": plan.n, "temperature": plan.temperature,
                       "max_new_tokens": plan.max_new_tokens} for name, (p, _, plan) in self.work.items()}  # fmt: skip

    def evaluate_now(self, update: int, worker, load: bool = True) -> dict:
        """Sync: evaluate the trainer's weights of update ``update`` on ``worker`` and record it.

        ``load``: give the worker the trainer's weights first (False: it already holds them). Nothing may be
        in flight on the trainer ranks. The worker's death stops the run.
        """
        what = f"rollout worker 0, evaluating update {update},"
        if load:
            self.run.get(worker.update_weights.remote(self.run.publish()), what)
        t0 = time.perf_counter()
        records = {name: self.run.get(worker.evaluate.remote(r["prompts"], r["n"], r["temperature"],
                                                             r["max_new_tokens"]), what)
                   for name, r in self.requests().items()}  # fmt: skip
        return self.record(update, records, time.perf_counter() - t0)

    def evaluate_final(self, worker_holds_final: bool) -> None:
        """After the update loop (both modes): evaluate the final policy unless that is done already.

        ``worker_holds_final``: rollout worker 0 already holds the final weights (sync: the last stage's broadcast).
        """
        total = self.run.sched.total_updates
        if self.run.sched.final_eval_due(self.last):
            self.evaluate_now(total, self.run.workers[0], load=not worker_holds_final)

    def save_candidate(self, update: int) -> Path:
        """Async: the policy of update ``update``, saved now (it may become ``best`` when its result comes)."""
        path = self.run.run_dir / "checkpoints" / f".eval-candidate-{update:08d}"
        self.run.on_trainers("save_hf", str(path))
        return path

    @staticmethod
    def drop_candidate(candidate: Path) -> None:
        """Async: a candidate whose evaluation never came back is removed."""
        shutil.rmtree(candidate, ignore_errors=True)

    def record(self, update: int, records: dict[str, list], t_eval: float, candidate: Path | None = None) -> dict:
        """Summarise per-problem ``records`` into the eval record; keep the policy if it is the best so far."""
        from mugrpo_async.evaluation.benchmarks import summarize

        summaries = {n: summarize(n, recs, self.run.cfg.eval.ks, self.work[n][1]) for n, recs in records.items()}
        scores = [s["pass@1"] for s in summaries.values() if s["pass@1"] is not None]
        mean = sum(scores) / len(scores) if scores else None
        rec = {"kind": "eval", "update": update, "policy_version": update, "eval/mean": mean,
               **{f"eval/{n}": s["pass@1"] for n, s in summaries.items()}, "benchmarks": summaries,
               "t_eval_s": t_eval, "t_wall_s": time.perf_counter() - self.run.t0, "best": False}  # fmt: skip
        best_dir = self.run.run_dir / "checkpoints" / "best"
        if mean is not None and mean > self.best:
            self.best, rec["best"] = mean, True
            if candidate is not None:
                atomic_replace_dir(candidate, best_dir)
            else:
                self.run.on_trainers("save_hf", str(best_dir))
        elif candidate is not None:
            shutil.rmtree(candidate, ignore_errors=True)
        self.last = max(self.last, update)
        self.run.sink.write(rec)
        log.info("eval at update %d: %s (best %.4f)", update,
                 ", ".join(f"{n} {s['pass@1']}" for n, s in summaries.items()), self.best)  # fmt: skip
        return rec
