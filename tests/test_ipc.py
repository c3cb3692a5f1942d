"""Unit: the ``cuda_ipc`` weight sync's protocol (`mugrpo_async.weight_sync.ipc`) on CPU shared memory.

A trainer member serves the store and stages the buckets; readers in other processes (spawned, as an engine's
worker is its own process) open the handles, copy the buckets out and ack. No Ray, no vLLM: the engine side's
``reload_weights`` is exercised by tests/test_weight_sync_ipc.py.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import time

import pytest
import torch

from mugrpo_async.weight_sync import backend_problems
from mugrpo_async.weight_sync.buckets import param_buckets
from mugrpo_async.weight_sync.ipc import device_key, join, leave, read_state, share_state

_BUCKET = 1024  # bytes: the params below make 6 buckets, so both staging buffers are reused


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(3):
        out[f"model.layers.{i}.mlp.weight"] = torch.randn(12, 10, generator=g)
        out[f"model.layers.{i}.mlp.bias"] = torch.randn(12, generator=g).to(torch.bfloat16)
    out["model.embed_tokens.weight"] = torch.randn(40, 8, generator=g)
    out["lm_head.weight"] = torch.randn(40, 8, generator=g).to(torch.float16)
    return out


def _read(port: int, key: str, syncs: list[int], stop_after: int | None, out) -> None:
    """A reader process: join as a reader of ``key``, read every sync in ``syncs`` and send back what it got."""
    member = join("127.0.0.1", port, key, timeout_s=20, reads=True)
    out.put(("joined", member.reader))
    for sync_id in syncs:
        version, weights = read_state(member, sync_id)
        got = {}
        for i, (name, t) in enumerate(weights):
            if stop_after is not None and i >= stop_after:
                break
            got[name] = t.clone()
        out.put((version, got, len(member.opened)))
    time.sleep(1)  # keep the mappings open until the trainer has seen the acks


def _start_readers(port: int, key: str, n: int, syncs: list[int], stop_after: int | None = None):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_read, args=(port, key, syncs, stop_after, out), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    joined = sorted(out.get(timeout=60)[1] for _ in procs)
    assert joined == list(range(n))  # each registered as its own reader of the device
    return procs, out


class _Gathers:
    """A recording stand-in of ZeRO-3's per-bucket gather."""

    def __init__(self):
        self.entered = 0

    @contextlib.contextmanager
    def __call__(self, tensors):
        self.entered += 1
        yield


def test_two_readers_get_every_tensor_over_two_syncs_through_two_reused_buffers():
    port, key = _port(), device_key(torch.device("cpu"), "10.0.0.1", 3)
    assert key == "cpu/10.0.0.1/3"
    trainer = join("127.0.0.1", port, key, timeout_s=20, serve=True)
    procs, out = _start_readers(port, key, 2, [1, 2])
    gathers = _Gathers()
    for sync_id, seed in ((1, 0), (2, 1)):
        params = _params(seed)
        buckets = param_buckets(params, _BUCKET)
        assert len(buckets) >= 4
        assert share_state(trainer, params, sync_id, 10 * sync_id, _BUCKET, torch.device("cpu"), gathers,
                           lambda ts: True)  # fmt: skip
        for _ in procs:
            version, got, opened = out.get(timeout=30)
            assert version == 10 * sync_id and list(got) == list(params)
            for name, t in params.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t)
            assert opened == 2  # the two staging buffers, opened once and kept across syncs
    assert gathers.entered == 2 * len(buckets)
    handles = list(trainer.handles)
    assert len(handles) == 2 and trainer.slots[0].is_shared()
    for p in procs:
        p.join(10)
    leave(trainer)
    assert trainer.slots == [] and trainer.handles == []


def test_nonfinite_weights_still_complete_the_sync_and_say_so():
    port, key = _port(), "cpu/n/0"
    trainer = join("127.0.0.1", port, key, timeout_s=20, serve=True)
    procs, out = _start_readers(port, key, 1, [1])
    params = _params(2)
    params["model.layers.1.mlp.weight"][0, 0] = float("nan")
    finite = lambda ts: all(bool(torch.isfinite(t).all()) for t in ts)  # noqa: E731
    assert not share_state(trainer, params, 1, 5, _BUCKET, torch.device("cpu"), _Gathers(), finite)
    version, got, _ = out.get(timeout=30)
    assert version == 5 and list(got) == list(params)  # the readers were not left waiting
    procs[0].join(10)


def test_a_reader_that_stops_makes_the_send_raise_within_the_timeout_after_every_gather():
    port, key = _port(), "cpu/n/0"
    trainer = join("127.0.0.1", port, key, timeout_s=2, serve=True)
    procs, out = _start_readers(port, key, 1, [1], stop_after=1)  # reads one tensor of the first bucket, then stops
    gathers, params = _Gathers(), _params(3)
    t0 = time.perf_counter()
    with pytest.raises(Exception, match="(?i)timeout|timed out|wait"):
        share_state(trainer, params, 1, 1, _BUCKET, torch.device("cpu"), gathers, lambda ts: True)
    assert time.perf_counter() - t0 < 10
    assert gathers.entered == len(param_buckets(params, _BUCKET))  # ZeRO-3's ranks stay in step
    procs[0].join(10)


def test_a_device_without_readers_stages_nothing():
    trainer = join("127.0.0.1", _port(), "cpu/n/7", timeout_s=5, serve=True)
    gathers, params = _Gathers(), _params(4)
    assert share_state(trainer, params, 1, 1, _BUCKET, torch.device("cpu"), gathers, lambda ts: True)
    assert gathers.entered == len(param_buckets(params, _BUCKET))


def test_backend_rules():
    assert backend_problems("cuda_ipc", "sync", on_gpu=True, colocated=True) == []
    assert backend_problems("cuda_ipc", "sync", on_gpu=False, colocated=True) == []  # shared memory on CPU
    assert "placement.mode=colocated" in backend_problems("cuda_ipc", "sync", on_gpu=True)[0]
    assert "schedule.mode=sync" in backend_problems("cuda_ipc", "async", on_gpu=True, colocated=True)[0]


def test_the_gpu_check_of_the_protocol_runs_on_cpu_and_checks_every_tensor():
    from bench.ipc_check import measure

    (r,) = measure(torch.device("cpu"), {"small": 2e5}, repeats=2, bucket_mb=0.05).values()
    assert "error" not in r, r
    assert r["bytes"] > 0 and r["ipc_s"] > 0 and r["ipc_gbps"] == pytest.approx(r["bytes"] / r["ipc_s"] / 1e9)
