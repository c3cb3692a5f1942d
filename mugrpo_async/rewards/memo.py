"""Reward bookkeeping for one rollout worker: which (response, reference) pairs are known, queued and sent,
and what a lost scorer costs. Ray-free; ``actors.reward.RewardMemo`` adds the scorer calls.

A pair's reward is a pure function of the pair, so each distinct pair is scored once and remembered
(successes only: a scoring that timed out or raised may succeed another time). New pairs are queued
and sent in batches of ``batch_size``, round robin over the scorers; a scorer streams one score per pair,
in order, so at any time the first unscored pair of a scorer's earliest pending batch is the one it is
working on. That is what :meth:`PairBook.scorer_lost` relies on when a scorer is killed past its
deadline (:func:`pair_deadline_s`) or dies:

- killed (stuck): the pair in progress scores 0 and counts as a failure (it blocked past every timeout);
- died: the pair in progress is charged once and re-sent; a pair charged twice scores 0 and counts;
- every pair queued behind it on that scorer is re-sent (it never started).

Each loss settles or charges one pair, so re-sending ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Pair = tuple[str, str]
"""(response text, reference answer)."""

Score = tuple[float, bool]
"""(reward, failed): failed flags a timeout, an error or a lost scorer (the reward is then 0)."""

GRACE_S = 2.0
"""Seconds a scorer gets beyond one math-verify timeout per pair (the stream's hop, a busy CPU)."""

STARTUP_S = 120.0
"""Seconds a new or restarted scorer may take to start (a process, then importing math-verify)."""


def pair_deadline_s(timeout_s: float) -> float:
    """Longest wait for a scorer's next score before it counts as stuck and is restarted.

    math-verify bounds each of its calls with ``signal.alarm(ceil(timeout_s))``, but an answer can block
    in C code that the alarm cannot interrupt (``\\boxed{1E+100000000}``: Python's ``decimal`` converting
    a 10^8-digit integer), and then the scorer never answers. Scores stream one per pair, so the wait is
    per pair, not per batch: ``ceil(timeout_s) + GRACE_S`` (7 s at the default 5 s). Typical pairs take
    milliseconds, and a pathological one that the alarm does stop ends within one alarm plus
    milliseconds; a pair that would need several slow math-verify calls in a row scores 0 here, as it
    would have on its own alarm in nearly every case. A stuck scorer thus holds up its worker for at
    most this long, plus its restart, once per stuck pair.
    """
    return math.ceil(timeout_s) + GRACE_S


@dataclass
class Batch:
    """Pairs sent to one scorer in one call; ``done`` of them have their score."""

    id: int
    scorer: int
    pairs: list[Pair]
    done: int = 0

    @property
    def finished(self) -> bool:
        return self.done >= len(self.pairs)


class PairBook:
    """Known rewards, queued pairs and pending batches of one worker (see the module docstring).

    Use: :meth:`add` each finished group (send the batch it returns), then at collection :meth:`flush`,
    feed each pending batch's scores in order (:meth:`next_batch`, :meth:`scored`), report lost scorers
    (:meth:`scorer_lost`, :meth:`give_up`), and :meth:`finish` for the rewards.

    Args:
        num_scorers: scorers that batches go to, round robin.
        batch_size: pairs per scorer call.
        limit: known pairs kept; the oldest are forgotten first.
    """

    def __init__(self, num_scorers: int, batch_size: int = 64, limit: int = 200_000):
        if num_scorers < 1 or batch_size < 1 or limit < 0:
            raise ValueError(
                f"need num_scorers, batch_size >= 1 and limit >= 0, got {num_scorers}, {batch_size}, {limit}"
            )
        self.num_scorers, self.batch_size, self.limit = num_scorers, batch_size, limit
        self.known: dict[Pair, float] = {}
        self.queued: set[Pair] = set()  # waiting or pending, until finish
        self.waiting: list[Pair] = []  # queued, not yet sent
        self.pending: list[Batch] = []  # sent, not all scores in, in send order
        self.results: dict[Pair, Score] = {}  # scored since the last finish
        self.charges: dict[Pair, int] = {}  # times a scorer died with the pair in progress
        self._sent = 0

    def add(self, texts: list[str], answer: str) -> Batch | None:
        """Queue one group's unknown pairs; returns a batch of all waiting pairs once ``batch_size`` or more wait."""
        for text in texts:
            pair = (text, answer)
            if pair not in self.known and pair not in self.queued:
                self.queued.add(pair)
                self.waiting.append(pair)
        return self.flush() if len(self.waiting) >= self.batch_size else None

    def flush(self) -> Batch | None:
        """A batch of every waiting pair (None if none wait)."""
        pairs, self.waiting = self.waiting, []
        return self._batch(pairs) if pairs else None

    def _batch(self, pairs: list[Pair]) -> Batch:
        batch = Batch(id=self._sent, scorer=self._sent % self.num_scorers, pairs=pairs)
        self._sent += 1
        self.pending.append(batch)
        return batch

    def next_batch(self) -> Batch | None:
        """The earliest pending batch (whose next score to wait for), None when all are scored."""
        return self.pending[0] if self.pending else None

    def scored(self, batch: Batch, score: Score) -> None:
        """The score of ``batch``'s next pair arrived."""
        self.results[batch.pairs[batch.done]] = (float(score[0]), bool(score[1]))
        batch.done += 1
        if batch.finished:
            self.pending.remove(batch)

    def scorer_lost(self, scorer: int, stuck: bool) -> list[Batch]:
        """Scorer ``scorer`` was killed (``stuck``) or died: settle its pair in progress, re-batch the rest.

        Returns:
            New batches (round robin, at most ``batch_size`` pairs each) to send once the scorer is back.
        """
        lost = [b for b in self.pending if b.scorer == scorer]
        self.pending = [b for b in self.pending if b.scorer != scorer]
        unscored = [p for b in lost for p in b.pairs[b.done :]]
        if not unscored:
            return []
        current = unscored[0]
        self.charges[current] = self.charges.get(current, 0) + 1
        if stuck or self.charges[current] >= 2:
            self.results[current] = (0.0, True)
            unscored = unscored[1:]
        return [self._batch(unscored[i : i + self.batch_size]) for i in range(0, len(unscored), self.batch_size)]

    def give_up(self, batch: Batch) -> None:
        """``batch``'s scorer cannot take it (it did not come back): its unscored pairs score 0 and fail."""
        for pair in batch.pairs[batch.done :]:
            self.results[pair] = (0.0, True)
        batch.done = len(batch.pairs)
        self.pending.remove(batch)

    def finish(self, texts: list[list[str]], answers: list[str]) -> tuple[list[list[float]], int]:
        """Rewards per group (G texts, one reference each) and the count of failed scorings since the last call.

        Every pair must be known or scored (pending batches all settled). Successes are remembered,
        failures are not; per-call state is reset and the memory trimmed to ``limit``.
        """
        if self.pending or self.waiting:
            raise RuntimeError(f"{len(self.pending)} batches and {len(self.waiting)} pairs still unscored")
        rewards = [[self._reward((t, a)) for t in group] for group, a in zip(texts, answers)]
        failures = sum(failed for _, failed in self.results.values())
        self.known.update((pair, r) for pair, (r, failed) in self.results.items() if not failed)
        while len(self.known) > self.limit:
            del self.known[next(iter(self.known))]
        self.results, self.queued, self.charges = {}, set(), {}
        return rewards, failures

    def _reward(self, pair: Pair) -> float:
        return self.results[pair][0] if pair in self.results else self.known[pair]
