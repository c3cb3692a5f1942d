"""Reward scoring for a rollout worker: warm scorer actors and a memo of scored pairs.

math-verify's timeouts rely on ``signal.alarm``, which works only in a process's main thread, so
scoring runs in plain (single-threaded) actors, never in threads. Scorer actors rather than a Ray task
per call: Ray retires idle task workers within seconds, and every call then waited for fresh processes
to import math-verify (measured: 1.0-6.1 s a call against 0.24-0.36 s back to back). The scorers take
no CPU reservation: the engine and the scorers of one worker share the CPU reserved for it.
"""

from __future__ import annotations

import logging

import ray

from mugrpo_async.config import RewardConfig

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=-1)
class RewardScorer:
    """A rollout worker's reward scorer: scores pairs in its main thread (math-verify's alarm timeouts
    work there) while the engine generates. An actor, not per-call tasks, so that it stays warm."""

    def score(self, texts: list[str], answers: list[str], timeout_s: float) -> list[tuple[float, bool]]:
        return score_pairs(texts, answers, timeout_s)


def score_pairs(texts: list[str], answers: list[str], timeout_s: float) -> list[tuple[float, bool]]:
    """(reward, failed) per (response text, reference) pair, in the calling thread."""
    from mugrpo_async.rewards.boxed_math import score_batch

    out = []
    for text, answer in zip(texts, answers):
        (reward,), failed = score_batch([text], [answer], timeout_s=timeout_s)
        out.append((reward, bool(failed)))
    return out


class RewardMemo:
    """Rewards of the (response text, reference) pairs a worker has scored, scored off its critical path.

    The reward is a pure function of the pair, and pairs repeat: the G samples of a prompt often
    agree, and a small model's answers to recurring prompts recur across stages, so each distinct pair
    is scored once (on the tiny task about a third of a stage's responses repeat one of the same stage).
    :meth:`submit` sends new pairs to the scorer actors in batches (round robin) while generation goes on;
    :meth:`collect` waits for what is left and returns the rewards. If the scorer fails or does not
    answer in time, its pairs are scored here instead. A scoring that timed out or raised scores 0, is
    counted, and is not remembered. At most ``limit`` pairs are kept (the oldest forgotten first).
    """

    BATCH = 64  # pairs per scorer call

    def __init__(self, cfg: RewardConfig, scorers: list, limit: int = 200_000):
        self.timeout_s, self.scorers, self.limit = cfg.timeout_s, scorers, limit
        self.known: dict[tuple[str, str], float] = {}
        self.waiting: list[tuple[str, str]] = []  # not yet sent
        self.sent: list[tuple[list[tuple[str, str]], object]] = []  # (pairs, ref)
        self.queued: set[tuple[str, str]] = set()

    def submit(self, texts: list[str], answer: str) -> None:
        """Queue one group's responses for scoring (sent in batches of :attr:`BATCH`)."""
        for text in texts:
            key = (text, answer)
            if key not in self.known and key not in self.queued:
                self.queued.add(key)
                self.waiting.append(key)
        if len(self.waiting) >= self.BATCH:
            self._send()

    def _send(self) -> None:
        pairs, self.waiting = self.waiting, []
        scorer = self.scorers[len(self.sent) % len(self.scorers)]  # round robin
        ref = scorer.score.remote([t for t, _ in pairs], [a for _, a in pairs], self.timeout_s)
        self.sent.append((pairs, ref))

    def collect(self, texts: list[list[str]], answers: list[str]) -> tuple[list[list[float]], int]:
        """Per group (G texts, one reference), the G rewards; and the count of failed scorings."""
        for group, answer in zip(texts, answers):
            self.submit(group, answer)  # pairs not submitted while generating (none, when streaming worked)
        if self.waiting:
            self._send()
        results: dict[tuple[str, str], tuple[float, bool]] = {}
        for pairs, ref in self.sent:
            try:
                scored = ray.get(ref, timeout=self.timeout_s * len(pairs) + 60)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as err:
                log.warning("reward scorer failed (%s); scoring %d responses here", type(err).__name__, len(pairs))
                scored = score_pairs([t for t, _ in pairs], [a for _, a in pairs], self.timeout_s)
            results.update(zip(pairs, scored))
        self.sent, self.queued = [], set()
        failures = sum(failed for _, failed in results.values())
        rewards = [[results[(t, a)][0] if (t, a) in results else self.known[(t, a)] for t in g]
                   for g, a in zip(texts, answers)]  # fmt: skip
        self.known.update((k, r) for k, (r, failed) in results.items() if not failed)
        while len(self.known) > self.limit:
            del self.known[next(iter(self.known))]
        return rewards, failures
