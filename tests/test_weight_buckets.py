"""Bucket plans of the collective weight sync, and the gloo group's send/receive between two processes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket

import pytest
import torch

from mugrpo_async.weight_sync import CPU_DEFAULT, GPU_DEFAULT, backend_problems, resolve_backend
from mugrpo_async.weight_sync.buckets import bucket_nbytes, plan_buckets, unit_of

_PARTS = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "mlp.up_proj.weight", "input_layernorm.weight")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"model.embed_tokens.weight": torch.randn(64, 16, generator=g)}
    for i in range(3):
        for part in _PARTS:
            shape = (16,) if part.endswith(("bias", "layernorm.weight")) else (32, 16)
            out[f"model.layers.{i}.{part}"] = torch.randn(shape, generator=g).to(torch.bfloat16)
    out["model.norm.weight"] = torch.randn(16, generator=g)
    return out


def _sizes(state):
    return [(k, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
            for k, t in state.items()]  # fmt: skip


def test_buckets_keep_blocks_whole_in_order_and_aligned():
    sizes = _sizes(_state())
    buckets = plan_buckets(sizes, bucket_bytes=3000)
    assert [e.name for b in buckets for e in b] == [s[0] for s in sizes]  # every tensor once, in order
    units = [{unit_of(e.name) for e in b} for b in buckets]
    for i, a in enumerate(units):  # no unit split across buckets
        assert all(not (a & b) for b in units[i + 1 :])
    assert unit_of("model.layers.2.mlp.up_proj.weight") == "model.layers.2"
    assert unit_of("model.embed_tokens.weight") == "model.embed_tokens"
    for b in buckets:
        assert all(e.offset % 64 == 0 for e in b)
        ends = [e.offset + e.nbytes for e in b]
        assert all(end <= nxt.offset for end, nxt in zip(ends, b[1:]))
        # a bucket holds one unit that is too big alone, or fits the bound
        assert bucket_nbytes(b) <= 3000 or len({unit_of(e.name) for e in b}) == 1
    assert len(plan_buckets(sizes, bucket_bytes=1 << 30)) == 1
    with pytest.raises(ValueError):
        plan_buckets(sizes, 0)


def test_backend_resolution_and_problems():
    assert resolve_backend("auto", "async", on_gpu=True) == "object_store"
    assert resolve_backend("auto", "sync", on_gpu=True) == GPU_DEFAULT
    assert resolve_backend("auto", "sync", on_gpu=False) == CPU_DEFAULT
    assert resolve_backend("collective", "sync", on_gpu=False) == "collective"
    assert resolve_backend("auto", "sync", on_gpu=True, colocated=True) == "cuda_ipc"
    assert resolve_backend("auto", "sync", on_gpu=False, colocated=True) == CPU_DEFAULT
    assert resolve_backend("auto", "async", on_gpu=True, colocated=True) == "object_store"
    assert "placement.mode=colocated" in backend_problems("cuda_ipc", "sync", on_gpu=False)[0]
    assert "schedule.mode=sync" in backend_problems("collective", "async", on_gpu=False)[0]
    assert backend_problems("object_store", "async", on_gpu=False) == []


def _member(rank: int, port: int, out) -> None:
    from mugrpo_async.weight_sync.group import join_group, receive_state, send_state

    torch.set_num_threads(1)
    group = join_group("127.0.0.1", port, rank, 3, "gloo", 30.0, "127.0.0.1")
    for sync_id in (1, 2):
        state = {k: v + sync_id for k, v in _state().items()}
        if rank == 0:
            ok = send_state(group, state, sync_id, 10 + sync_id, 3000, lambda ts: contextlib.nullcontext(),
                            lambda ts: all(bool(torch.isfinite(t).all()) for t in ts))  # fmt: skip
            out.put((rank, sync_id, ok))
            continue
        version, items = receive_state(group, sync_id)
        held = list(items)  # views kept to the end, as vLLM keeps a layer's tensors until the layer completes
        same = [k for k, _ in held] == list(state) and all(torch.equal(t, state[k]) for k, t in held)
        out.put((rank, sync_id, version == 10 + sync_id and same))


def test_gloo_group_broadcasts_every_bucket_to_every_member():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")  # started in milliseconds (spawn re-imports torch: seconds)
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, port, out)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    results = sorted(out.get(timeout=5) for _ in range(6))
    assert results == [(r, s, True) for r in range(3) for s in (1, 2)]
