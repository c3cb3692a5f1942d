"""Update U+1 in flight while update U is recorded: the one pipelining rule of both update loops.

Each trainer rank runs its calls in submission order, so the driver submits update U+1 before it waits
for update U's metrics, and the ranks never wait for the driver. The loops use it like this::

    pipe = UpdatePipeline(record)
    for U in updates:
        step = Step(U, submit_update(U))            # + the weight export right behind it, when due
        pipe.push(step)                             # seals a begun checkpoint, records update U-1
        if due.barrier:
            pipe.drain()                            # nothing in flight: evaluate / checkpoint update U
            pipe.seal_after_next(begin_checkpoint(U))
    pipe.close()

- Before an evaluation or a checkpoint nothing is in flight (:meth:`UpdatePipeline.drain`): the evaluated
  or saved weights are those of update U, and an async queue snapshot holds every unserved group.
- A checkpoint begun after update U (the ranks' saves submitted) is sealed once update U+1 is submitted
  (:meth:`UpdatePipeline.seal_after_next`): each rank saves before it runs U+1, and checking the files and
  writing checksums overlaps U+1.
- A due weight export is submitted right behind its update, in the same :class:`Step`, so every rank
  exports before it runs U+1; the record of U publishes it.

Ray-free: it only orders the caller's callbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Step:
    """One update submitted to the trainer ranks and not yet recorded."""

    update: int  # 1-based: the update this step makes
    refs: list  # the update call's result, one per rank
    groups: list | None = None  # async: the minibatch (its group ids go into the record)
    exports: list | None = None  # the weight export submitted right behind it, when a publish is due


class UpdatePipeline:
    """At most one update in flight, recorded by ``record(step)`` in update order."""

    def __init__(self, record: Callable[[Step], Any]):
        self.record = record
        self.inflight: Step | None = None
        self.sealing: Callable[[], Any] | None = None
        self.last: Any = None  # what the newest ``record`` returned

    def push(self, step: Step) -> None:
        """``step`` was just submitted: seal a checkpoint begun before it, then record the update before it."""
        self._seal()
        if self.inflight is not None:
            self.last = self.record(self.inflight)
        self.inflight = step

    def drain(self) -> None:
        """Record the update in flight, so that nothing is in flight (before an evaluation or a checkpoint)."""
        if self.inflight is not None:
            step, self.inflight = self.inflight, None
            self.last = self.record(step)

    def seal_after_next(self, seal: Callable[[], Any]) -> None:
        """Call ``seal()`` (a begun checkpoint's commit) right after the next update is submitted."""
        if self.inflight is not None:
            raise RuntimeError("a checkpoint begins only with nothing in flight: drain() first")
        self._seal()
        self.sealing = seal

    def close(self) -> None:
        """The loop ended: record what is in flight and seal what is begun."""
        self.drain()
        self._seal()

    def _seal(self) -> None:
        if self.sealing is not None:
            seal, self.sealing = self.sealing, None
            seal()
