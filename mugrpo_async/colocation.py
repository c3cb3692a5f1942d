"""The staged loop on colocated devices (``placement.mode = colocated``): who holds each device in which phase.

Engine i and trainer rank i share device i (:mod:`mugrpo_async.placement`), so they take turns. One
:class:`Colocation` owns the order, for every engine and rank at once::

    rollout phase:  trainer offloads its optimizer states and gradients -> engine wakes its weights ->
                    the new weights are loaded -> engine wakes its KV cache -> (the stage is generated)
    training phase: engine sleeps -> trainer reloads its states -> (mu updates)

The sleep level follows from whether the engine's weights must be kept. Level 2 discards weights and KV cache
(vLLM keeps only the model's buffers, on the host): right whenever the next rollout phase loads new weights, which
the staged loop always does (its weights change with every update), and nothing is copied to host memory.
Level 1 moves the weights to host memory and discards the KV cache: for an engine that must run the same weights
again without a load (``keep_weights``).

:meth:`Colocation.expected` is the memory each device should hold in a phase (weights, KV cache, optimizer states,
gradients: :func:`device_memory`, from the estimates of :mod:`mugrpo_async.reporting.memory`); every step is
recorded in :attr:`Colocation.steps`, and the staged driver writes them into its stage records.

Resuming: actors start with everything resident (the ``start`` phase: engine awake, holding the checkpoint's
weights that the run loaded at start, trainer states on the device). The staged driver begins every stage with
:meth:`Colocation.to_rollout` (no load), which from ``start`` only offloads the trainer; then the stage's dataset
is generated, or found complete on disk when the run resumed inside the stage's updates, and
:meth:`Colocation.to_training` leaves the devices as an uninterrupted run has them there. ``to_training`` straight
from ``start`` also holds: the engines sleep and nothing is reloaded that was never offloaded.

Pure: the engines and the ranks are handed in as :class:`EngineSleep` and :class:`TrainerOffload` (the driver's
adapters call every actor and wait).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol

from mugrpo_async.config import Config

log = logging.getLogger(__name__)

PHASES = ("start", "rollout", "training")
ENGINE_TAGS = ("weights", "kv_cache")
"""What a sleeping vLLM engine releases; :meth:`EngineSleep.wake_up` takes them one at a time."""


class EngineSleep(Protocol):
    """Every rollout engine of the run (vLLM's ``LLM.sleep`` / ``LLM.wake_up``)."""

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: list[str]) -> None: ...


class TrainerOffload(Protocol):
    """Every trainer rank (DeepSpeed's ``offload_states`` / ``reload_states`` of its ZeRO optimizer)."""

    def offload_states(self) -> None: ...

    def reload_states(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes one colocated device holds, by owner (engine: its 1/k share under tensor parallel size k)."""

    engine_weights: int = 0
    kv_cache: int = 0
    trainer_weights: int = 0
    gradients: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Bytes per device of each state when resident (the engine's are one device's share)."""

    engine_weights: int
    kv_cache: int
    trainer_weights: int
    gradients: int
    optimizer: int


def footprint(cfg: Config) -> Footprint | None:
    """Per-device sizes of ``cfg``'s states (None: the model's sizes are unknown). The trainer's: ZeRO's model
    states per rank (the reference model, when ``algo.kl_coef > 0``, counts as resident weights); the engine's:
    its weights and its KV cache for one minibatch, split over ``rollout.tensor_parallel_size`` devices."""
    from mugrpo_async.reporting.plan import build_plan

    plan = build_plan(cfg)
    if plan.trainer is None or plan.arch is None:
        return None
    k = cfg.rollout.tensor_parallel_size
    kv_heads = max(1, plan.arch.num_kv_heads // k)  # each device keeps at least one KV head
    return Footprint(
        engine_weights=-(-plan.engine_weights // k),
        kv_cache=plan.kv_cache * kv_heads // plan.arch.num_kv_heads,
        trainer_weights=plan.trainer["weights"] + plan.reference_model,
        gradients=plan.trainer["gradients"],
        optimizer=plan.trainer["optimizer"],
    )


def device_memory(fp: Footprint, engine: set[str], trainer_resident: bool) -> DeviceMemory:
    """What one device holds with the engine's ``engine`` tags awake and the trainer's states resident or not
    (the trainer's weights always are: the export of new weights and the next update read them)."""
    return DeviceMemory(
        engine_weights=fp.engine_weights if "weights" in engine else 0,
        kv_cache=fp.kv_cache if "kv_cache" in engine else 0,
        trainer_weights=fp.trainer_weights,
        gradients=fp.gradients if trainer_resident else 0,
        optimizer=fp.optimizer if trainer_resident else 0,
    )


class Colocation:
    """The phase order of colocated engines and trainer ranks (module docstring), with what each step leaves.

    Attributes:
        phase: ``start`` (all resident), ``rollout`` or ``training``.
        awake: The engines' tags on the device.
        trainer_resident: The ranks' optimizer states and gradients are on the device (as far as the calls go: with
            ``trainer_offloads`` False, :func:`offload_unsupported`, the ranks' offload is a no-op and
            :meth:`expected` counts them resident in every phase).
        steps: Every call made, in order (``trainer.offload_states``, ``engine.wake_up(weights)``,
            ``load_weights``, ``engine.wake_up(kv_cache)``, ``engine.sleep(2)``, ``trainer.reload_states``), with
            ``rollout`` / ``training`` marking each phase's start.
    """

    def __init__(self, engines: EngineSleep, trainers: TrainerOffload, fp: Footprint | None = None,
                 trainer_offloads: bool = True):  # fmt: skip
        self.engines, self.trainers, self.fp, self.trainer_offloads = engines, trainers, fp, trainer_offloads
        self.phase = "start"
        self.awake: set[str] = set(ENGINE_TAGS)
        self.trainer_resident = True
        self.steps: list[str] = []

    def to_rollout(self, load: Callable[[], object] | None = None) -> None:
        """Hand the devices to the engines: offload the trainer's states, wake the engines' weights, ``load()`` the
        new weights into them (None: they hold the right ones), wake the KV cache. Steps already done are
        skipped (the engines are awake at the run's start)."""
        if self.trainer_resident:
            self._step("trainer.offload_states", self.trainers.offload_states)
            self.trainer_resident = False
        if "weights" not in self.awake:
            self._step("engine.wake_up(weights)", lambda: self.engines.wake_up(["weights"]))
            self.awake.add("weights")
        if load is not None:
            self._step("load_weights", load)
        if "kv_cache" not in self.awake:
            self._step("engine.wake_up(kv_cache)", lambda: self.engines.wake_up(["kv_cache"]))
            self.awake.add("kv_cache")
        self._enter("rollout")

    def to_training(self, keep_weights: bool = False) -> None:
        """Hand the devices to the trainer: the engines sleep (level 1 with ``keep_weights``, else 2: module
        docstring), then the trainer's states come back (nothing to reload when they were never offloaded)."""
        level = 1 if keep_weights else 2
        if self.awake:
            self._step(f"engine.sleep({level})", lambda: self.engines.sleep(level))
            self.awake.clear()
        if not self.trainer_resident:
            self._step("trainer.reload_states", self.trainers.reload_states)
            self.trainer_resident = True
        self._enter("training")

    def expected(self) -> DeviceMemory | None:
        """The bytes each device should hold now (None without a :class:`Footprint`)."""
        if self.fp is None:
            return None
        return device_memory(self.fp, self.awake, self.trainer_resident or not self.trainer_offloads)

    def take_steps(self) -> list[str]:
        """The steps recorded since the last call (the stage record's ``colocation_steps``)."""
        out, self.steps = self.steps, []
        return out

    def _step(self, name: str, call: Callable[[], object]) -> None:
        call()
        self.steps.append(name)

    def _enter(self, phase: str) -> None:
        if phase != self.phase:
            self.phase = phase
            self.steps.append(phase)
            memory = self.expected()
            if memory is not None:
                log.info("colocated devices: %s phase, about %.1f MiB each", phase, memory.total / 2**20)


def offload_unsupported(zero_stage: int, on_cuda: bool, optimizer_offloads: bool) -> str:
    """Why a trainer rank cannot offload its states (empty: it can). DeepSpeed 0.19 offloads the states of its ZeRO
    1-3 optimizers (``DeepSpeedEngine.offload_states``); the ZeRO-0 wrappers (bf16 / fp16 optimizers) have no such
    method."""
    if zero_stage == 0 or not optimizer_offloads:
        return (f"DeepSpeed offloads only ZeRO 1-3 optimizer states (trainer.zero_stage = {zero_stage}): they stay "
                "resident while the engine generates")  # fmt: skip
    if not on_cuda:
        return "the trainer runs on CPU: its states already live in host memory"
    return ""


def phase_memory(cfg: Config) -> dict[str, DeviceMemory] | None:
    """Per GPU, the memory of the ``rollout`` phase (engine weights + KV cache, trainer states offloaded where
    DeepSpeed can) and the ``training`` phase (engine asleep at level 2); None when the model's sizes are unknown."""
    fp = footprint(cfg)
    if fp is None:
        return None
    offloads = not offload_unsupported(cfg.trainer.zero_stage, True, True)
    return {"rollout": device_memory(fp, set(ENGINE_TAGS), not offloads), "training": device_memory(fp, set(), True)}
