"""When an engine call counts as hung: no progress, not a long wall time.

At paper scale one healthy generation call (hundreds of groups of G responses of up to 8k tokens) runs for
tens of minutes, so any wall-clock deadline per call either kills healthy engines or waits as long for a
hung one. A call is hung when it stops making progress: no token generated and no group finished for
``rollout.stall_timeout_s`` seconds, whatever its length.

Worker side, :class:`Progress`: counts the tokens the engine generates (every step's engine-core outputs,
:func:`new_tokens`: vLLM's ``LLM`` asks for final outputs only, so a step's request outputs show nothing of
the requests still generating) and the groups it finishes, and says when a report is due: at the start and
end of a call, and between them at most one per ``report_s``, only when a counter moved. A stalled worker
therefore goes quiet. Reports are ``{"busy", "tokens", "groups"}`` (counters over the worker's life); the
worker's streaming calls yield them (``actors.rollout.RolloutWorker``).

Driver side, :class:`StallWatch`: per watched call, when its counters last moved, in the driver's own
clock (reports carry no time, so the clocks of different nodes never mix). A busy call whose counters
have not moved for ``timeout_s`` has stalled. A call is busy from its submission (or from a report that
says so) until its result is ready, so one that hangs before its first token is caught too; the reward
scoring left after its last group is inside that window (each answer bounded by the scorers' own
deadline, :func:`~mugrpo_async.rewards.memo.pair_deadline_s`). A call that reports it is not busy (an async
worker waiting for weights or a grant) has no clock.

Ray-free and vLLM-free: engine-core outputs are read through their ``new_token_ids`` only.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

REPORTS_PER_TIMEOUT = 4
"""Reports a busy worker sends per ``stall_timeout_s`` at most (a report lost to a busy driver costs little)."""

MAX_REPORT_S = 10.0
"""Longest interval between two reports of a call that makes progress."""


def new_tokens(core_outputs: Iterable) -> int:
    """Tokens generated in one engine step: the ``new_token_ids`` of its engine-core outputs (vLLM's
    ``EngineCoreOutput``, one per request that advanced)."""
    return sum(len(o.new_token_ids) for o in core_outputs)


def report_interval(stall_timeout_s: float) -> float:
    """Seconds between a worker's progress reports: ``stall_timeout_s / 4``, at most 10 s."""
    return min(MAX_REPORT_S, stall_timeout_s / REPORTS_PER_TIMEOUT)


class Progress:
    """A rollout worker's progress counters and report throttle.

    Args:
        report_s: shortest interval between two reports in a call (:func:`report_interval`).
    """

    def __init__(self, report_s: float):
        self.report_s = report_s
        self.tokens = 0  # generated over the worker's life
        self.groups = 0  # finished (all G samples of a prompt) over the worker's life
        self.busy = False
        self._last_report = -math.inf
        self._reported: tuple[int, int] | None = None

    def report(self) -> dict:
        """The counters as a report (what the worker yields)."""
        self._reported = (self.tokens, self.groups)
        return {"busy": self.busy, "tokens": self.tokens, "groups": self.groups}

    def begin(self, now: float) -> dict:
        """An engine call starts; returns the report that says so."""
        self.busy, self._last_report = True, now
        return self.report()

    def end(self) -> dict:
        """The call ended (its result is ready); returns the report that says so."""
        self.busy = False
        return self.report()

    def count(self, tokens: int = 0, groups: int = 0) -> None:
        """``tokens`` more generated, ``groups`` more finished."""
        self.tokens += tokens
        self.groups += groups

    def due(self, now: float) -> dict | None:
        """A report if one is due at ``now``: a counter moved and ``report_s`` passed since the last one."""
        if (self.tokens, self.groups) == self._reported or now - self._last_report < self.report_s:
            return None
        self._last_report = now
        return self.report()


@dataclass
class _Clock:
    busy: bool
    since: float  # driver time of the last move (or of becoming busy)
    counts: tuple[int, int] | None = None


class StallWatch:
    """Which watched calls have stalled: busy, and no counter moved for ``timeout_s`` (driver clock).

    Keys are whatever identifies a call to the driver (a Ray ``ObjectRefGenerator``, a chunk number).
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.clocks: dict[Hashable, _Clock] = {}

    def start(self, key: Hashable, now: float, busy: bool = True) -> None:
        """Watch a new call: busy (its clock runs from ``now``) or idle until it reports busy."""
        self.clocks[key] = _Clock(busy, now)

    def observe(self, key: Hashable, report: dict, now: float) -> None:
        """A report of ``key`` arrived: its clock restarts when it became busy or a counter moved."""
        clock = self.clocks.get(key)
        if clock is None:
            return
        counts = (report["tokens"], report["groups"])
        if report["busy"] and (not clock.busy or counts != clock.counts):
            clock.since = now
        clock.busy, clock.counts = report["busy"], counts

    def forget(self, key: Hashable) -> None:
        """Stop watching ``key`` (its call ended, or its worker was killed)."""
        self.clocks.pop(key, None)

    def stalled(self, now: float) -> list:
        """Busy calls without progress for ``timeout_s`` or longer, oldest first."""
        late = [(c.since, i, key) for i, (key, c) in enumerate(self.clocks.items())
                if c.busy and now - c.since >= self.timeout_s]  # fmt: skip
        return [key for _, _, key in sorted(late)]

    def wait_s(self, now: float) -> float | None:
        """Seconds until the next call could stall (0: one has); None when no call is busy."""
        deadlines = [c.since + self.timeout_s for c in self.clocks.values() if c.busy]
        return max(0.0, min(deadlines) - now) if deadlines else None

    def describe(self, key: Hashable, now: float) -> str:
        """How long ``key`` has been without progress and what it had done, for the log."""
        c = self.clocks[key]
        done = f"{c.counts[0]} tokens and {c.counts[1]} groups" if c.counts else "no report yet"
        return f"no token generated and no group finished for {now - c.since:.0f}s ({done} on that worker)"
