"""When the update loop publishes weights, evaluates, checkpoints and stops: one set of rules for both modes.

Updates are counted from 1: "after update U" means that U optimizer updates are done; T is
``schedule.total_updates``. With P the publishing interval (sync: ``mu``, the stage length, whose end's
weights generate the next stage; async: ``schedule.sync_every``):

- **publish** the weights after U when ``U % P == 0``;
- **policy version** of update U: the newest version published when it started, ``(U-1) - (U-1) % P``;
- **evaluate** after U when ``eval.every_updates`` divides U and U < T; the final policy is evaluated once,
  after the loop (:meth:`Schedule.final_eval_due`), in both modes the same way;
- **checkpoint** after U when ``U % C == 0`` or U == T, where C is ``checkpoint.every_updates`` or, when that
  is 0, ``min(mu, max(1, T // 4))`` (every stage, or every mu updates, and at least 4 times per run);
- **stop** when ``trainer.max_nonfinite_updates`` updates in a row were skipped for a non-finite loss or
  gradient norm (:class:`NonfiniteStreak`).

A resumed run continues after the checkpoint's update: :meth:`Schedule.updates` and, in sync mode,
:meth:`Schedule.stages` / :meth:`Schedule.stage_updates` start there. Ray-free and torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Due:
    """What happens after one update (see the module docstring for the rules)."""

    publish: bool
    evaluate: bool
    checkpoint: bool
    stage_end: bool  # sync: the stage's last update (its end is handled after the stage's update loop)

    @property
    def barrier(self) -> bool:
        """Nothing may be in flight after this update: an evaluation or a checkpoint needs its weights."""
        return self.evaluate or self.checkpoint


@dataclass(frozen=True)
class Schedule:
    """The due-rules of a run; build it with :meth:`from_config`."""

    total_updates: int  # T
    mu: int  # sync: updates per stage; async: the lag cap
    publish_every: int  # P: mu (sync) or sync_every (async)
    checkpoint_every: int  # C
    eval_every: int  # 0: only the final policy is evaluated
    eval_enabled: bool
    staged: bool  # sync mode

    @classmethod
    def from_config(cls, cfg: Any) -> Schedule:
        """The rules of a :class:`~mugrpo_async.config.Config`."""
        s = cfg.schedule
        staged = s.mode == "sync"
        return cls(
            total_updates=s.total_updates,
            mu=s.mu,
            publish_every=s.mu if staged else s.sync_every,
            checkpoint_every=checkpoint_interval(cfg.checkpoint.every_updates, s.mu, s.total_updates),
            eval_every=cfg.eval.every_updates,
            eval_enabled=bool(cfg.eval.benchmarks),
            staged=staged,
        )

    def after(self, update: int) -> Due:
        """What is due after update ``update`` (1-based)."""
        if not 1 <= update <= self.total_updates:
            raise ValueError(f"update {update} is outside 1..{self.total_updates}")
        periodic_eval = self.eval_enabled and self.eval_every > 0 and update % self.eval_every == 0
        return Due(
            publish=update % self.publish_every == 0,
            evaluate=periodic_eval and update < self.total_updates,
            checkpoint=update % self.checkpoint_every == 0 or update == self.total_updates,
            stage_end=self.staged and update % self.mu == 0,
        )

    def policy_version(self, update: int) -> int:
        """The behaviour version update ``update`` (1-based) trains from: the newest published before it."""
        done = update - 1
        return done - done % self.publish_every

    def final_eval_due(self, last_evaluated: int | None) -> bool:
        """Whether the final policy still needs its evaluation (``last_evaluated``: newest evaluated update)."""
        return self.eval_enabled and last_evaluated != self.total_updates

    def updates(self, done: int) -> range:
        """The updates left after ``done`` (a resume position), 1-based."""
        return range(done + 1, self.total_updates + 1)

    def stages(self, done: int) -> range:
        """Sync: the stages left after ``done`` updates (a stage started but not finished is included)."""
        return range(done // self.mu, self.total_updates // self.mu)

    def stage_updates(self, stage: int, done: int) -> range:
        """Sync: stage ``stage``'s updates (1-based) that are left after ``done`` updates."""
        first = stage * self.mu
        return range(max(done, first) + 1, first + self.mu + 1)


def checkpoint_interval(every_updates: int, mu: int, total_updates: int) -> int:
    """C: ``checkpoint.every_updates``, or when 0, every mu updates but at least 4 times per run."""
    return every_updates or min(mu, max(1, total_updates // 4))


class NonfiniteStreak:
    """Counts consecutive updates skipped for a non-finite loss or gradient norm; ``limit`` in a row stop the run.

    The trainer ranks skip such an optimizer step and report ``nonfinite_skipped`` (1 for a skipped update,
    absent or 0 otherwise); a skipped update leaves weights and optimizer state as they were, so whatever was
    published or checkpointed before the stop holds the weights of the last good update.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"the limit must be at least 1, got {limit}")
        self.limit = limit
        self.count = 0
        self.first: int | None = None  # first update of the current streak

    @staticmethod
    def skipped(record: dict) -> bool:
        """Whether an update record says its optimizer step was skipped (absent key: it was not)."""
        value = record.get("nonfinite_skipped") or 0
        return float(value) > 0

    def observe(self, update: int, skipped: bool) -> bool:
        """Count update ``update``; True when it makes ``limit`` skipped updates in a row (stop the run)."""
        if not skipped:
            self.count, self.first = 0, None
            return False
        self.count += 1
        self.first = update if self.first is None else self.first
        return self.count >= self.limit

    def describe(self, update: int) -> str:
        """Why the run stops at ``update`` (the streak's last update)."""
        span = f"update {update}" if self.first == update else f"updates {self.first}-{update}"
        return (
            f"{span}: loss or gradient norm not finite, optimizer step skipped {self.count} times in a row "
            f"(trainer.max_nonfinite_updates={self.limit}); nothing was published or checkpointed after them"
        )
