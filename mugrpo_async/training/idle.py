"""The trainer's idle clock: how much of its wall time a trainer rank spends waiting for work.

``t_wait_s`` is the time from the end of the previous step to the start of this one (waiting for the
minibatch and assembling it); ``t_step_s`` the step itself. ``trainer_idle_ratio`` = cumulative wait /
(cumulative wait + cumulative step time) since training began (``restart``), and it continues across a resume
(``state`` / ``load``).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class IdleClock:
    """Cumulative wait and busy time of one trainer rank."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.cum_wait = self.cum_busy = 0.0
        self.restart()

    def restart(self) -> None:
        """Count from now (when training begins, not when the rank was created); totals start at 0."""
        self.t_last_end = self.clock()
        self.cum_wait = self.cum_busy = 0.0
        self.t_begin = self.t_last_end

    def begin_step(self) -> float:
        """The step starts now; returns the wait since the previous step ended."""
        self.t_begin = self.clock()
        wait = self.t_begin - self.t_last_end
        self.cum_wait += wait
        return wait

    def end_step(self) -> float:
        """The step ended now; returns its duration."""
        self.t_last_end = self.clock()
        busy = self.t_last_end - self.t_begin
        self.cum_busy += busy
        return busy

    @property
    def idle_ratio(self) -> float:
        return self.cum_wait / max(self.cum_wait + self.cum_busy, 1e-9)

    def state(self) -> dict[str, float]:
        return {"cum_wait_s": self.cum_wait, "cum_busy_s": self.cum_busy}

    def load(self, state: dict) -> None:
        """Continue the totals of a checkpoint; the next wait counts from now."""
        self.cum_wait, self.cum_busy = float(state["cum_wait_s"]), float(state["cum_busy_s"])
        self.t_last_end = self.clock()
