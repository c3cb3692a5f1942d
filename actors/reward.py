"""Reward scoring for a rollout worker: warm scorer actors behind a memo of scored pairs.

The reward is a plugin (``reward.function``, :mod:`mugrpo_async.rewards.plugins`; math-verify by default): the
scorers import it and call it per response, with ``reward.timeout_s``; a call that raises or times out scores 0
and is counted, a result that is not one finite number per response stops the worker's call with an error
naming the function.

math-verify's timeouts rely on ``signal.alarm``, which works only in a process's main thread, so
scoring runs in plain (single-threaded) actors, never in threads. Scorer actors rather than a Ray task
per call: Ray retires idle task workers within seconds, and every call then waited for fresh processes
to import math-verify (measured: 1.0-6.1 s a call against 0.24-0.36 s back to back). The scorers take
no CPU reservation: the engine and the scorers of one worker share the CPU reserved for it.

The alarm cannot stop an answer that blocks in C code, so the worker never trusts a scorer to return:
scores stream back one per pair, a scorer silent past :func:`~mugrpo_async.rewards.memo.pair_deadline_s`
is killed and restarted by Ray, and the worker itself never scores (the policy: :mod:`mugrpo_async.rewards.memo`).
"""

from __future__ import annotations

import logging
import os
import time

import ray

from actors.quiet import quiet_process
from mugrpo_async.config import RewardConfig
from mugrpo_async.rewards.memo import STARTUP_S, Batch, PairBook, pair_deadline_s
from mugrpo_async.rewards.plugins import DEFAULT_FUNCTION, RewardPluginError, context_key, load_function, uses_context

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=-1)
class RewardScorer:
    """A rollout worker's reward scorer: scores pairs in its main thread (math-verify's alarm timeouts
    work there) while the engine generates. An actor, not per-call tasks, so that it stays warm."""

    def __init__(self, log_level: str = "INFO"):
        quiet_process(log_level)
        from mugrpo_async.rewards import boxed_math  # noqa: F401 - math-verify imported before the scorer is ready

    def score(self, texts: list[str], keys: list[str], timeout_s: float, spec: str = DEFAULT_FUNCTION,
              options: dict | None = None, with_context: bool = False, search_dir: str | None = None):  # fmt: skip
        """Yields ``(reward, failed)`` per (response text, key) pair, in order, as each is scored with the
        plugin ``spec`` (a key is the reference, or with ``with_context`` the prompt's JSON: ``context_key``),
        imported from ``search_dir`` (the memo owner's working dir) or a package."""
        from mugrpo_async.rewards.plugins import score_pair

        for text, key in zip(texts, keys):
            yield score_pair(spec, options or {}, timeout_s, text, key, with_context, search_dir)

    def load(self, spec: str, search_dir: str | None = None) -> bool:
        """Import the plugin (before the first batch, so that the first answer does not pay for it)."""
        return load_function(spec, search_dir) is not None


class RewardMemo:
    """Rewards of the (response text, reference) pairs a worker has scored, scored off its critical path.

    The reward is a pure function of the pair, and pairs repeat: the G samples of a prompt often
    agree, and a small model's answers to recurring prompts recur across stages, so each distinct pair
    is scored once (on the tiny task about a third of a stage's responses repeat one of the same stage).
    :meth:`submit` sends new pairs to the scorer actors in batches (round robin) while generation goes on;
    :meth:`collect` waits for what is left and returns the rewards. A scoring that timed out or raised
    scores 0, is counted, and is not remembered. A scorer that stays silent past the per-pair deadline is
    killed and restarted; its pair in progress scores 0 and is counted, and the pairs queued behind it are
    re-sent once it is back. A scorer that died is restarted by Ray; its pair in progress gets one more try
    (:class:`~mugrpo_async.rewards.memo.PairBook`). The worker never scores an answer itself.

    Args:
        cfg: ``reward`` section (``function`` and ``options``: the plugin; ``timeout_s``: its time per response).
        scorers: :class:`RewardScorer` handles.
        limit: known pairs kept (the oldest forgotten first).
        batch_size: pairs per scorer call.
    """

    def __init__(self, cfg: RewardConfig, scorers: list, limit: int = 200_000, batch_size: int = 64):
        self.timeout_s, self.scorers = cfg.timeout_s, scorers
        self.spec, self.options = cfg.function, dict(cfg.options)
        self.search_dir = os.getcwd()  # the job's working dir: plugins are imported from there on the scorers too
        default = cfg.function == DEFAULT_FUNCTION  # math-verify is imported by the scorers alone, as it always was
        self.with_context = not default and uses_context(load_function(cfg.function, self.search_dir))
        self.deadline_s = pair_deadline_s(cfg.timeout_s)
        self.book = PairBook(len(scorers), batch_size, limit)
        self.streams: dict[int, ray.ObjectRefGenerator] = {}  # batch id -> its scores
        # Scorers not yet seen ready -> a readiness call submitted before any batch (None: none pending).
        self.starting = {i: sc.__ray_ready__.remote() for i, sc in enumerate(scorers)}
        self.restarts = 0

    def warm_up(self) -> None:
        """Every scorer imports the plugin; the default scores one pair (math-verify's path, not the integer
        shortcut). Waits for all."""
        if self.spec == DEFAULT_FUNCTION:
            ray.get([ref for sc in self.scorers for ref in sc.score.remote(["\\boxed{1/2}"], ["0.5"], self.timeout_s)])
        else:
            ray.get([sc.load.remote(self.spec, self.search_dir) for sc in self.scorers])
        self.starting.clear()

    def key(self, prompt: dict) -> str:
        """What the scorers need of ``prompt`` (its answer; with a plugin that reads them, also its text and meta):
        pass it as the ``answer`` of :meth:`submit` and :meth:`collect`."""
        return context_key(prompt, self.with_context)

    def submit(self, texts: list[str], answer: str) -> None:
        """Queue one group's responses for scoring (sent in batches)."""
        batch = self.book.add(texts, answer)
        if batch is not None:
            self._send(batch)

    def flush(self) -> None:
        """Send the pairs waiting for a full batch now (their rewards are collected soon)."""
        batch = self.book.flush()
        if batch is not None:
            self._send(batch)

    def collect(self, texts: list[list[str]], answers: list[str]) -> tuple[list[list[float]], int]:
        """Per group (G texts, one reference), the G rewards; and the count of failed scorings."""
        for group, answer in zip(texts, answers):
            self.submit(group, answer)  # pairs not submitted while generating (none, when streaming worked)
        self.flush()
        while (batch := self.book.next_batch()) is not None:
            self._advance(batch)
        self.streams.clear()
        return self.book.finish(texts, answers)

    def _send(self, batch: Batch) -> None:
        pairs = batch.pairs
        texts, keys = [t for t, _ in pairs], [a for _, a in pairs]
        scorer = self.scorers[batch.scorer]
        args = (self.timeout_s, self.spec, self.options, self.with_context, self.search_dir)
        ref = scorer.score.remote(texts, keys, *args)
        self.streams[batch.id] = ref

    def _advance(self, batch: Batch) -> None:
        """Take ``batch``'s next score, waiting at most the deadline; a stuck or dead scorer is handled."""
        i = batch.scorer
        if i in self.starting and not self._wait_ready(i):
            self.book.give_up(batch)
            return
        stream = self.streams[batch.id]
        try:
            ready, _ = ray.wait([stream], timeout=self.deadline_s)
            if ready:
                self.book.scored(batch, ray.get(next(stream)))
                return
            stuck = True
            log.warning("reward scorer %d silent for %.0fs on one answer: restarting it", i, self.deadline_s)
            ray.kill(self.scorers[i], no_restart=False)
            self.restarts += 1
        except RewardPluginError:  # the function's own fault (wrong shape, not finite): say so, do not retry
            raise
        except (ray.exceptions.RayError, StopIteration) as err:
            stuck = False
            log.warning("reward scorer %d failed (%s); re-sending its unscored answers", i, type(err).__name__)
        self.starting[i] = None
        back = self._wait_ready(i)
        for resend in self.book.scorer_lost(i, stuck):
            if resend.scorer == i and not back:
                self.book.give_up(resend)
            else:
                self._send(resend)

    def _wait_ready(self, i: int) -> bool:
        """Wait at most :data:`STARTUP_S` until scorer ``i`` answers (after its start or a restart)."""
        ref, deadline = self.starting.pop(i, None), time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            try:
                ray.get(ref or self.scorers[i].__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
                return True
            except ray.exceptions.GetTimeoutError:
                break
            except ray.exceptions.RayActorError:  # restarting: calls fail until it is back
                ref = None
                time.sleep(0.2)
        log.error("reward scorer %d did not start within %.0fs; its answers score 0", i, STARTUP_S)
        self.starting[i] = None
        return False
