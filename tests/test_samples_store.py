"""Sample schema, msgpack round trips, the rollout store, packed weights, batching and prompt order."""

import json

import pytest
import torch

from mugrpo_async.data.pool import PromptStream
from mugrpo_async.rollout.samples import Group, SampleError, decode_groups, encode_groups
from mugrpo_async.rollout.shards import StageWriter, read_groups, read_stage, resolve
from mugrpo_async.training.batching import by_length, collate, flatten, token_logprobs
from mugrpo_async.training.weights import pack_state_dict, unpack_state_dict


def make_group(pid="p0", version=3, lengths=(2, 3)):
    return Group(
        prompt_id=pid,
        prompt_ids=[5, 6, 7],
        answer="12",
        responses=[list(range(10, 10 + n)) for n in lengths],
        behavior_logprobs=[[-0.5 - 0.25 * j for j in range(n)] for n in lengths],
        rewards=[1.0, 0.0][: len(lengths)] + [0.0] * (len(lengths) - 2),
        advantages=[0.7, -0.7][: len(lengths)] + [0.0] * (len(lengths) - 2),
        policy_version=version,
        finish_reasons=["stop"] * len(lengths),
        meta={"level": 2},
    )


def test_group_invariants():
    g = make_group()
    assert g.group_size == 2
    with pytest.raises(SampleError, match="log-probs"):
        Group(**{**g.__dict__, "behavior_logprobs": [[0.0], [0.0, 0.0, 0.0]]})
    with pytest.raises(SampleError, match="rewards"):
        Group(**{**g.__dict__, "rewards": [1.0]})
    with pytest.raises(SampleError, match="policy_version"):
        Group(**{**g.__dict__, "policy_version": -1})
    with pytest.raises(SampleError, match="non-finite"):
        Group(**{**g.__dict__, "behavior_logprobs": [[0.0, float("nan")], [0.0] * 3]})


def test_msgpack_roundtrip_is_exact_in_float32():
    groups = [make_group("a"), make_group("b", version=7, lengths=(4, 1))]
    back = decode_groups(encode_groups(groups))
    assert [g.prompt_id for g in back] == ["a", "b"]
    assert back == groups and back[1].policy_version == 7  # log-probs of these values are exact in float32
    assert back[1].responses[0].dtype == "int32" and back[0].behavior_logprobs[1].dtype == "float32"
    assert back[0].meta == {"level": 2} and back[0] != make_group("a", lengths=(2, 4))
    with pytest.raises(SampleError):
        decode_groups(b"\x93garbage")


def test_store_writes_shards_and_detects_corruption(tmp_path):
    w = StageWriter(tmp_path / "stage-0", 0, "abc")
    w.add([make_group("a")])
    partial = json.loads((tmp_path / "stage-0" / "manifest.json").read_text())
    assert partial["complete"] is False and len(partial["shards"]) == 1  # a crash here keeps shard 0
    w.add([make_group("b"), make_group("c")])
    w.finish()
    manifest, groups = read_stage(tmp_path / "stage-0")
    assert manifest["complete"] and [g.prompt_id for g in groups] == ["a", "b", "c"]
    shard = tmp_path / "stage-0" / "shard-00001.msgpack"
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(SampleError, match="shard-00001"):
        read_stage(tmp_path / "stage-0")


def test_groups_are_read_one_by_one_from_their_shards_and_checked(tmp_path):
    """The writer keeps refs, not groups; the refs read back the groups (after reopening too), and a group whose
    bytes changed after indexing is refused by name while the others still read."""
    import msgpack

    from mugrpo_async.rollout.samples import encode_groups_indexed

    groups = [make_group(f"g{k}", version=k, lengths=(k + 1, 2)) for k in range(5)]
    data, spans = encode_groups_indexed(groups)
    assert data == msgpack.packb([g.to_wire() for g in groups], use_bin_type=True)  # the shard format is unchanged
    w = StageWriter(tmp_path / "s", 0, "abc", num_chunks=2, chunk_size=3)
    w.add(groups[:3], 0)
    w.add(groups[3:], 1)
    w.finish()
    assert not hasattr(w, "groups") and [r.prompt_id for r in w.all_refs()] == [f"g{k}" for k in range(5)]
    again = StageWriter.open(tmp_path / "s", 0, "abc", num_chunks=2, chunk_size=3).all_refs()
    assert again == w.all_refs() and again[4].rewards == (1.0, 0.0) and again[4].response_tokens == 7
    order = [4, 0, 2]
    assert read_groups([again[k] for k in order]) == [groups[k] for k in order]
    assert resolve([groups[1], again[3]]) == [groups[1], groups[3]]
    shard = tmp_path / "s" / "shard-00001.msgpack"
    raw = bytearray(shard.read_bytes())
    raw[again[4].offset + again[4].nbytes - 2] ^= 0xFF  # inside group g4's bytes
    shard.write_bytes(bytes(raw))
    with pytest.raises(SampleError, match="shard-00001.*g4.*checksum"):
        read_groups([again[3], again[4]])
    assert read_groups([again[3]]) == [groups[3]]
    reopened = StageWriter.open(tmp_path / "s", 0, "abc", num_chunks=2, chunk_size=3)
    assert reopened.missing() == [1] and reopened.corrupt == ["shard-00001.msgpack"]  # generated again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_weights_roundtrip(dtype):
    state = {"a.weight": torch.randn(3, 4).to(dtype), "b.bias": torch.randn(5).to(dtype), "c": torch.arange(3)}
    packed = pack_state_dict(state, version=12)
    assert packed.version == 12 and packed.nbytes >= sum(t.numel() * t.element_size() for t in state.values())
    back = unpack_state_dict(packed)
    assert list(back) == list(state)
    for k in state:
        assert back[k].dtype == state[k].dtype and torch.equal(back[k], state[k])


def test_collate_aligns_tokens_and_logprobs():
    groups = [make_group("a", lengths=(2, 3)), make_group("b", lengths=(1, 4))]
    batch = collate(flatten(groups), pad_id=0)
    assert batch.input_ids.shape == (4, 3 + 4) and batch.response_mask.sum(1).tolist() == [2, 3, 1, 4]
    row = batch.input_ids[3]
    assert row[batch.response_index[3, :4]].tolist() == groups[1].responses[1].tolist()
    assert batch.behavior_logprobs[1, :3].tolist() == groups[0].behavior_logprobs[1].tolist()
    assert batch.advantages.tolist() == pytest.approx([0.7, -0.7, 0.7, -0.7])
    mb = batch.slice(2, 3)
    assert mb.input_ids.shape == (1, 4) and mb.response_mask.shape == (1, 1)


def test_by_length_orders_rows_stably_and_pads_less():
    groups = [make_group("a", lengths=(4, 1)), make_group("b", lengths=(2, 1)), make_group("c", lengths=(4, 2))]
    rows = by_length(flatten(groups))
    assert [(g.prompt_id, i) for g, i in rows] == [("a", 1), ("b", 1), ("b", 0), ("c", 1), ("a", 0), ("c", 0)]
    padded = [collate(r, pad_id=0).input_ids.numel() for r in (flatten(groups)[:3], rows[:3])]
    assert padded == [3 * 7, 3 * 5]


def test_token_logprobs_matches_a_loop():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    groups = [make_group("a", lengths=(2, 3)), make_group("b", lengths=(1, 4))]
    rows = flatten(groups)
    with torch.no_grad():
        lp = token_logprobs(model, collate(rows, pad_id=0))
        for k, (g, i) in enumerate(rows):
            seq = torch.tensor([[*g.prompt_ids, *g.responses[i]]])
            logits = model(input_ids=seq).logits[0].float().log_softmax(-1)
            p = len(g.prompt_ids)
            want = [logits[p + j - 1, tok].item() for j, tok in enumerate(g.responses[i])]
            assert lp[k, : len(want)].tolist() == pytest.approx(want, abs=1e-5)
            assert lp[k, len(want) :].abs().sum() == 0


def test_prompt_stream_is_seeded_and_covers_epochs():
    pool = [{"prompt_id": str(i)} for i in range(5)]
    a = PromptStream(pool, seed=1).take(12)
    b = PromptStream(pool, seed=1)
    assert [p["prompt_id"] for p in a] == [p["prompt_id"] for p in b.take(7) + b.take(5)]
    assert sorted(p["prompt_id"] for p in a[:5]) == [str(i) for i in range(5)]
    assert a[:5] != PromptStream(pool, seed=2).take(5) or a[5:10] != a[:5]
