"""The colocated phase controller (pure): its order and memory accounting against recording stand-ins of the
engine's sleep API and the trainer's offload API."""

from __future__ import annotations

import pytest

from mugrpo_async.colocation import Colocation, DeviceMemory, Footprint, footprint, offload_unsupported, phase_memory
from mugrpo_async.config import load_config
from tests.conftest import REPO

GiB = 1024**3
FP = Footprint(engine_weights=14, kv_cache=56, trainer_weights=2, gradients=3, optimizer=11)


class Device:
    """One device as the stand-ins' calls leave it: bytes per state on the device and in host memory."""

    def __init__(self, fp: Footprint):
        self.fp, self.log = fp, []
        self.on_device = {"engine_weights": fp.engine_weights, "kv_cache": fp.kv_cache,
                          "trainer_weights": fp.trainer_weights, "gradients": fp.gradients,
                          "optimizer": fp.optimizer}  # fmt: skip
        self.on_host: dict[str, int] = {}

    def move(self, key: str, to_device: bool, keep: bool = True) -> None:
        src, dst = (self.on_host, self.on_device) if to_device else (self.on_device, self.on_host)
        size = src.pop(key, 0) or getattr(self.fp, key)  # a discarded state comes back empty, at its size
        if keep or to_device:
            dst[key] = size

    def memory(self) -> DeviceMemory:
        return DeviceMemory(**self.on_device)


class Engine:
    """Records vLLM's sleep API: level 1 keeps the weights in host memory, level 2 discards them; both drop the
    KV cache; ``wake_up`` takes tags."""

    def __init__(self, dev: Device):
        self.dev = dev

    def sleep(self, level: int) -> None:
        assert level in (1, 2)
        self.dev.log.append(f"engine.sleep({level})")
        self.dev.move("engine_weights", to_device=False, keep=level == 1)
        self.dev.move("kv_cache", to_device=False, keep=False)

    def wake_up(self, tags: list[str]) -> None:
        (tag,) = tags
        self.dev.log.append(f"engine.wake_up({tag})")
        self.dev.move({"weights": "engine_weights", "kv_cache": "kv_cache"}[tag], to_device=True)


class Trainer:
    """Records DeepSpeed's offload of ZeRO states: optimizer states and gradients to host memory and back."""

    def __init__(self, dev: Device):
        self.dev = dev

    def offload_states(self) -> None:
        self.dev.log.append("trainer.offload_states")
        for key in ("optimizer", "gradients"):
            self.dev.move(key, to_device=False)

    def reload_states(self) -> None:
        self.dev.log.append("trainer.reload_states")
        for key in ("optimizer", "gradients"):
            self.dev.move(key, to_device=True)


def _controller() -> tuple[Colocation, Device]:
    dev = Device(FP)
    return Colocation(Engine(dev), Trainer(dev), FP), dev


def _load(dev: Device):
    def load() -> None:  # the new weights go into awake weights and before the KV cache is back
        assert "engine_weights" in dev.on_device and "kv_cache" not in dev.on_device
        dev.log.append("load_weights")

    return load


def test_a_fresh_run_takes_turns_in_the_paper_order_and_each_phase_holds_what_it_expects():
    ctl, dev = _controller()
    assert ctl.expected() == dev.memory() == DeviceMemory(14, 56, 2, 3, 11)  # actors start with all resident
    ctl.to_rollout()  # stage 0: the engines hold the model they started with
    assert dev.log == ["trainer.offload_states"]
    assert ctl.expected() == dev.memory() == DeviceMemory(14, 56, 2, 0, 0)
    assert dev.on_host == {"optimizer": 11, "gradients": 3}
    ctl.to_training()
    assert dev.log[1:] == ["engine.sleep(2)", "trainer.reload_states"]
    assert ctl.expected() == dev.memory() == DeviceMemory(0, 0, 2, 3, 11) and dev.on_host == {}  # level 2: nothing kept
    ctl.to_rollout(_load(dev))  # the stage's end: the next stage's weights
    assert dev.log[3:] == ["trainer.offload_states", "engine.wake_up(weights)", "load_weights",
                           "engine.wake_up(kv_cache)"]  # fmt: skip
    assert ctl.expected() == dev.memory() == DeviceMemory(14, 56, 2, 0, 0)
    ctl.to_rollout()  # the next stage starts where the last one left the devices: nothing to do
    assert len(dev.log) == 7 and ctl.phase == "rollout"
    assert ctl.take_steps() == ["trainer.offload_states", "rollout", "engine.sleep(2)", "trainer.reload_states",
                                "training", *dev.log[3:7], "rollout"]  # fmt: skip
    assert ctl.take_steps() == []


def test_an_engine_that_keeps_its_weights_sleeps_at_level_1_and_holds_them_in_host_memory():
    ctl, dev = _controller()
    ctl.to_rollout()
    ctl.to_training(keep_weights=True)
    assert dev.log[-2:] == ["engine.sleep(1)", "trainer.reload_states"]
    assert ctl.expected() == dev.memory() == DeviceMemory(0, 0, 2, 3, 11) and dev.on_host == {"engine_weights": 14}
    ctl.to_rollout()  # no load: the weights it kept come back
    assert dev.log[-3:] == ["trainer.offload_states", "engine.wake_up(weights)", "engine.wake_up(kv_cache)"]
    assert ctl.expected() == dev.memory() and dev.on_host == {"optimizer": 11, "gradients": 3}


def test_a_run_resumed_in_the_training_phase_starts_with_the_right_state():
    """Resumed inside stage k's updates, as the staged driver does it: fresh actors hold everything (the engines
    the checkpoint's weights), the stage begins with a rollout phase that only offloads (its dataset is on disk),
    and its training phase holds what an uninterrupted run's does."""
    ctl, dev = _controller()
    ctl.to_rollout()
    ctl.to_training()
    assert dev.log == ["trainer.offload_states", "engine.sleep(2)", "trainer.reload_states"]
    assert ctl.expected() == dev.memory() == DeviceMemory(0, 0, 2, 3, 11) and dev.on_host == {}
    ctl.to_rollout(_load(dev))  # the stage's end as in an uninterrupted run
    assert dev.log[3:] == ["trainer.offload_states", "engine.wake_up(weights)", "load_weights",
                           "engine.wake_up(kv_cache)"]  # fmt: skip
    assert ctl.expected() == dev.memory()


def test_training_straight_from_the_start_sleeps_the_engines_and_reloads_nothing():
    ctl, dev = _controller()
    ctl.to_training()
    assert dev.log == ["engine.sleep(2)"] and ctl.take_steps() == ["engine.sleep(2)", "training"]
    assert ctl.expected() == dev.memory() == DeviceMemory(0, 0, 2, 3, 11)
    ctl.to_rollout(_load(dev))  # the stage's end as in an uninterrupted run
    assert dev.log[1:] == ["trainer.offload_states", "engine.wake_up(weights)", "load_weights",
                           "engine.wake_up(kv_cache)"]  # fmt: skip
    assert ctl.expected() == dev.memory()


def test_a_run_resumed_at_a_stage_start_offloads_and_generates_with_the_weights_it_started_with():
    ctl, dev = _controller()
    ctl.to_rollout()
    assert dev.log == ["trainer.offload_states"] and ctl.expected() == dev.memory()


def test_a_failing_call_leaves_the_recorded_state_as_it_was():
    class Broken(Engine):
        def wake_up(self, tags: list[str]) -> None:
            raise RuntimeError("engine died")

    dev = Device(FP)
    ctl = Colocation(Broken(dev), Trainer(dev), FP)
    ctl.to_rollout()
    ctl.to_training()
    with pytest.raises(RuntimeError, match="engine died"):
        ctl.to_rollout()
    assert ctl.awake == set() and not ctl.trainer_resident and ctl.phase == "training"


def test_phase_memory_of_the_paper_model_per_device(tmp_path):
    """Qwen2.5-Math-7B (7.616 B parameters, bf16) on 8 colocated devices, ZeRO-3: hand-computed from the plan."""
    cfg = load_config(REPO / "configs" / "gpu" / "qwen2.5-math-7b-mu-grpo.yaml",
                      [f"model.path={tmp_path / 'Qwen2.5-Math-7B'}", "placement.mode=colocated",
                       "trainer.num_ranks=8", "rollout.num_workers=8", "trainer.gpus_per_rank=0.5",
                       "rollout.gpus_per_worker=0.5"])  # fmt: skip
    psi = 7_615_616_512
    fp = footprint(cfg)
    assert fp == Footprint(engine_weights=2 * psi, kv_cache=57344 * 256 * 4096, trainer_weights=-(-2 * psi // 8),
                           gradients=-(-2 * psi // 8), optimizer=-(-12 * psi // 8))  # fmt: skip
    phases = phase_memory(cfg)
    assert phases["rollout"] == DeviceMemory(fp.engine_weights, fp.kv_cache, fp.trainer_weights, 0, 0)
    assert phases["training"] == DeviceMemory(0, 0, fp.trainer_weights, fp.gradients, fp.optimizer)
    assert round(phases["rollout"].total / GiB, 2) == 71.96 and round(phases["training"].total / GiB, 2) == 14.19
    tp2 = footprint(load_config(REPO / "configs" / "gpu" / "qwen2.5-math-7b-mu-grpo.yaml",
                                [f"model.path={tmp_path / 'Qwen2.5-Math-7B'}", "placement.mode=colocated",
                                 "trainer.num_ranks=8", "rollout.num_workers=4", "rollout.tensor_parallel_size=2",
                                 "trainer.gpus_per_rank=0.5", "rollout.gpus_per_worker=0.5"]))  # fmt: skip
    assert (tp2.engine_weights, tp2.kv_cache) == (psi, fp.kv_cache // 2)  # an engine's share of its 2 devices
    assert phase_memory(load_config(None, ["model.path=/nowhere/unknown"])) is None


def test_zero_0_states_stay_resident_and_the_accounting_says_so(tmp_path):
    ctl, dev = _controller()
    ctl.trainer_offloads = False  # DeepSpeed's ZeRO-0 optimizers have no offload: the call is a no-op
    ctl.trainers.offload_states = lambda: dev.log.append("trainer.offload_states")
    ctl.to_rollout()
    assert dev.log == ["trainer.offload_states"] and ctl.expected() == dev.memory() == DeviceMemory(14, 56, 2, 3, 11)
    path = REPO / "configs" / "gpu" / "qwen2.5-math-7b-mu-grpo.yaml"
    over = [f"model.path={tmp_path / 'Qwen2.5-Math-7B'}", "placement.mode=colocated", "trainer.num_ranks=8",
            "rollout.num_workers=8", "trainer.gpus_per_rank=0.5", "rollout.gpus_per_worker=0.5"]  # fmt: skip
    zero0 = phase_memory(load_config(path, [*over, "trainer.zero_stage=0"]))
    assert zero0["rollout"].optimizer == zero0["training"].optimizer > 0


def test_which_trainer_ranks_can_offload():
    assert offload_unsupported(2, True, True) == offload_unsupported(3, True, True) == ""
    assert "trainer.zero_stage = 0" in offload_unsupported(0, True, False)  # DeepSpeed's bf16/fp16 wrappers have none
    assert "already live in host memory" in offload_unsupported(1, False, True)
