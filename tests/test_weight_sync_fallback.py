"""Unit: the group backends' fallback policy (`mugrpo_async.weight_sync.coordinator.CollectiveSync`), against
recording stand-ins of the actors (``ray.get`` patched to unwrap them).

A sync in which an engine fails gives it the weights through the object store and forms the group anew; a sync
that works again resets the count; two failed syncs in a row make the run keep to the object store.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray.exceptions import RayError

from mugrpo_async.weight_sync.coordinator import CollectiveSync, IpcSync


class _Method:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def remote(self, *args):
        self.actor.calls.append((self.name, *args))
        return self.actor.answer(self.name)


class _Actor:
    def __init__(self, name: str, failing: set | None = None):
        self.name, self.calls, self.failing = name, [], failing if failing is not None else set()

    def answer(self, method: str):
        if method in self.failing:
            return RayError(f"{self.name}.{method} failed")
        if method == "join_ipc":  # a rank's device key, an engine's keys (one per vLLM worker)
            return "cpu/n/0" if self.name.startswith("rank") else ["cpu/n/0"]
        return ("127.0.0.1", 1) if method == "rendezvous_address" else None

    def __getattr__(self, method):
        if method.startswith("__"):
            raise AttributeError(method)
        return _Method(self, method)

    def called(self, method: str) -> int:
        return sum(c[0] == method for c in self.calls)


def _get(value, timeout=None):
    if isinstance(value, list):
        return [_get(v) for v in value]
    if isinstance(value, Exception):
        raise value
    return value


@pytest.fixture
def run(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", _get)
    cfg = SimpleNamespace(trainer=SimpleNamespace(gpus_per_rank=0), weight_sync=SimpleNamespace(timeout_s=1),
                          rollout=SimpleNamespace(tensor_parallel_size=1))  # fmt: skip
    trainer, engine = _Actor("rank0"), _Actor("engine0")
    pool = SimpleNamespace(workers=[engine], restarts=0, weights=None, broadcasts=[])
    pool.broadcast = lambda ref, version: pool.broadcasts.append(version) or 0.0
    run = SimpleNamespace(cfg=cfg, trainers=[trainer], pool=pool, published=0)

    def publish():
        run.published += 1
        return f"ref{run.published}"

    run.publish = publish
    run.submit = lambda method, *args: [getattr(t, method).remote(*args) for t in run.trainers]
    run.collect = lambda refs, method: _get(refs)
    return run


@pytest.mark.parametrize("kind", [CollectiveSync, IpcSync])
def test_failed_syncs_fall_back_then_recover_then_give_up(run, kind, caplog):
    sync, (engine,), trainer = kind(run), run.pool.workers, run.trainers[0]
    sync.broadcast(1)  # works: formed once, the engine received it
    assert engine.called(kind.receive) == 1 and engine.called("update_weights") == 0 and sync.failed_in_row == 0
    engine.failing.add(kind.receive)
    sync.broadcast(2)  # fails: the engine gets the object store's copy
    assert engine.called("update_weights") == 1 and run.pool.weights == (2, "ref1") and sync.failed_in_row == 1
    engine.failing.clear()
    sync.broadcast(3)  # works again, over a group formed anew
    assert sync.failed_in_row == 0 and not sync.given_up
    joins = "join_ipc" if kind is IpcSync else "join_weight_group"
    assert engine.called(joins) == 2
    engine.failing.add(kind.receive)
    sync.broadcast(4)
    sync.broadcast(5)  # the second failure in a row
    assert sync.given_up and "keeps to object_store from here" in caplog.text
    receives = engine.called(kind.receive)
    sync.broadcast(6)  # the object store alone now
    assert engine.called(kind.receive) == receives and run.pool.broadcasts == [6]
    assert trainer.called(kind.send) == 5
