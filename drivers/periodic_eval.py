"""Evaluation during training: every ``eval.every_updates`` updates and at the end, the best policy kept.

Each evaluation writes one ``eval`` record to metrics.jsonl::

    {"kind": "eval", "update": U, "policy_version": U, "eval/<benchmark>": pass@1, ..., "eval/mean": mean,
     "eval/<benchmark>/level_<L>": pass@1 of level L, "eval/<benchmark>/format_rate": share boxed, ...,
     "benchmarks": {<benchmark>: summary}, "t_eval_s": ..., "t_wall_s": ..., "best": true|false}

(the level keys for problems with a level, the synthetic tasks'; the format rate for math benchmarks:
:func:`mugrpo_async.evaluation.benchmarks.summarize`)

and, when ``eval/mean`` is the best so far, the evaluated policy becomes ``checkpoints/best/`` (an HF
folder). Sync mode evaluates between training phases on every rollout worker (the trainer then holds the
evaluated weights): the weights go to every worker, the problems of all benchmarks are split into one
share per worker balanced by expected tokens (:mod:`mugrpo_async.evaluation.shares`), and the records are
merged back in problem order, so records and pass@k are those of one worker evaluating everything. A
share whose worker dies or stalls is evaluated again, like a lost chunk (``RolloutPool.evaluate``: the
restarted worker gets the evaluated weights); the run stops (:class:`~drivers.stops.RolloutFailed`) only
when no worker is left or a share keeps failing.

Async mode hands one worker a request through the sample queue, so that worker evaluates between two
generation batches while training goes on (the others keep generating); the policy of update U is saved
as a candidate folder when the request is made and becomes ``best`` (or is removed) when the result
arrives. When evaluations are due is :class:`~mugrpo_async.training.schedule.Schedule`'s rule; the final
policy is evaluated after the update loop, in both modes on every worker, by
:meth:`PeriodicEval.evaluate_final`.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from drivers.run import Run
from mugrpo_async.checkpoints.model_folder import atomic_replace_dir
from mugrpo_async.evaluation.shares import merge_eval, split_eval
from mugrpo_async.reporting.metrics import read_metrics

log = logging.getLogger(__name__)


def _breakdown(summaries: dict[str, dict]) -> dict[str, float]:
    """``eval/<benchmark>/level_<L>`` and ``eval/<benchmark>/format_rate`` of the summaries that have them."""
    out = {f"eval/{n}/level_{lv}": acc for n, s in summaries.items() for lv, acc in s.get("by_level", {}).items()}
    return out | {
        f"eval/{n}/format_rate": s["format_rate"] for n, s in summaries.items() if s.get("format_rate") is not None
    }


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

    def evaluate_now(self, update: int, load: bool = True) -> dict:
        """Evaluate the trainer's weights of update ``update`` on every rollout worker and record it.

        ``load``: broadcast the trainer's weights to the workers first (False: every worker holds them). Nothing
        may be in flight on the trainer ranks. The record adds ``eval_shares`` (workers that took part) and
        ``eval_worker_restarts`` (workers restarted meanwhile, their shares evaluated again).
        """
        pool = self.run.pool
        restarts = pool.restarts
        if load:
            self.run.weights.broadcast(update)
        requests = self.requests()
        shares = split_eval(requests, max(1, len(pool.workers)))
        t0 = time.perf_counter()
        results, _ = pool.evaluate(shares)
        records = merge_eval(requests, shares, results)
        extra = {"eval_shares": len(shares), "eval_worker_restarts": pool.restarts - restarts}
        return self.record(update, records, time.perf_counter() - t0, extra=extra)

    def evaluate_final(self, worker_holds_final: bool) -> None:
        """After the update loop (both modes): evaluate the final policy unless that is done already.

        ``worker_holds_final``: every rollout worker already holds the final weights (sync: the last stage's
        broadcast).
        """
        total = self.run.sched.total_updates
        if self.run.sched.final_eval_due(self.last):
            self.evaluate_now(total, load=not worker_holds_final)

    def save_candidate(self, update: int) -> Path:
        """Async: the policy of update ``update``, saved now (it may become ``best`` when its result comes)."""
        path = self.run.run_dir / "checkpoints" / f".eval-candidate-{update:08d}"
        self.run.on_trainers("save_hf", str(path))
        return path

    @staticmethod
    def drop_candidate(candidate: Path) -> None:
        """Async: a candidate whose evaluation never came back is removed."""
        shutil.rmtree(candidate, ignore_errors=True)

    def record(self, update: int, records: dict[str, list], t_eval: float, candidate: Path | None = None,
               extra: dict | None = None) -> dict:  # fmt: skip
        """Summarise per-problem ``records`` into the eval record (plus ``extra``); keep the policy if it is the
        best so far."""
        from mugrpo_async.evaluation.benchmarks import summarize

        summaries = {n: summarize(n, recs, self.run.cfg.eval.ks, self.work[n][1]) for n, recs in records.items()}
        scores = [s["pass@1"] for s in summaries.values() if s["pass@1"] is not None]
        mean = sum(scores) / len(scores) if scores else None
        rec = {"kind": "eval", "update": update, "policy_version": update, "eval/mean": mean,
               **{f"eval/{n}": s["pass@1"] for n, s in summaries.items()}, **_breakdown(summaries),
               "benchmarks": summaries,
               "t_eval_s": t_eval, "t_wall_s": time.perf_counter() - self.run.t0, "best": False,
               **(extra or {})}  # fmt: skip
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
