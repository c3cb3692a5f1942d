"""Export slots and the bucketed pack (`mugrpo_async.weight_sync.exports`): pure logic, threads, torch on CPU."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest
import torch

from mugrpo_async.training.weights import PackedWeights, pack_state_dict, unpack_state_dict
from mugrpo_async.weight_sync.exports import ExportSlots, pack_params


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(40, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "model.layers.1.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g),
    }


def _same(a: PackedWeights, b: PackedWeights) -> bool:
    """Equal entries and tensors (the alignment padding between tensors is never written)."""
    ta, tb = unpack_state_dict(a), unpack_state_dict(b)
    return a.entries == b.entries and all(torch.equal(ta[k], tb[k]) for k in ta)


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def test_bucketed_pack_equals_the_whole_state_pack_and_gathers_every_bucket_once():
    state, entered = _state(), []

    @contextlib.contextmanager
    def gathered(tensors):
        entered.append(len(tensors))
        yield

    packed = pack_params(state, 7, keep=True, bucket_bytes=300, gathered=gathered, finite=_finite)
    whole = pack_state_dict(state, 7)
    assert _same(packed, whole) and packed.version == 7
    assert sum(entered) == len(state) and len(entered) > 2  # several buckets, each tensor gathered once
    other = pack_params(state, 7, keep=False, bucket_bytes=300, gathered=gathered, finite=_finite)
    assert other is None and sum(entered) == 2 * len(state)  # a rank that keeps nothing still enters every gather


def test_pack_reuses_a_buffer_of_the_right_size_and_refuses_weights_that_are_not_finite():
    state = _state()
    first = pack_params(state, 1, keep=True, bucket_bytes=1 << 20, gathered=lambda t: contextlib.nullcontext(),
                        finite=_finite)  # fmt: skip
    state["model.norm.weight"] = state["model.norm.weight"] + 1
    again = pack_params(state, 2, keep=True, bucket_bytes=1 << 20, gathered=lambda t: contextlib.nullcontext(),
                        finite=_finite, out=first.buffer)  # fmt: skip
    assert again.buffer is first.buffer and _same(again, pack_state_dict(state, 2))
    state["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="update 3"):
        pack_params(state, 3, keep=True, bucket_bytes=300, gathered=lambda t: contextlib.nullcontext(), finite=_finite)


def _packed(version: int) -> PackedWeights:
    return PackedWeights(version, [], np.full(4, version, dtype=np.uint8))


def test_slots_hand_exports_over_in_order_and_bound_them_at_two():
    slots = ExportSlots()
    a, _ = slots.acquire(1)
    slots.ready(a, _packed(1))
    b, _ = slots.acquire(1)
    slots.ready(b, _packed(2))
    assert a != b and slots.waiting == 2
    with pytest.raises(TimeoutError):  # both slots hold exports not yet copied out
        slots.acquire(0.05)
    got: list = []

    def third():
        slot, _ = slots.acquire(5)
        got.append(slot)

    t = threading.Thread(target=third)
    t.start()
    time.sleep(0.05)
    assert not got  # still waiting for a slot
    slot, first = slots.take(1)
    assert first.version == 1 and slot == a
    slots.release(slot)
    t.join(5)
    assert got == [a]  # the freed slot, with the buffer it last held
    assert slots.buffers[a] is first.buffer and slots.take(1)[1].version == 2


def test_a_failed_pack_raises_in_its_take_and_frees_its_slot():
    slots = ExportSlots(count=1)
    slot, _ = slots.acquire(1)
    slots.fail(slot, FloatingPointError("update 5: the weights are not finite"))
    with pytest.raises(FloatingPointError, match="update 5"):
        slots.take(1)
    assert slots.acquire(0.05)[0] == slot
    with pytest.raises(TimeoutError):
        slots.take(0.05)
