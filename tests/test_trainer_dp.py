"""Integration: DeepSpeed micro-batching and 2-rank data parallelism give the single-pass gradient.

The same minibatch goes through (a) one rank, one micro-batch, (b) one rank, uneven micro-batches,
(c) two ZeRO-2 ranks with two micro-batches each, (d) two ZeRO-2 ranks with token-budget micro-batches and
chunked log-probs. Loss, pre-clip gradient norm and the weights after
one AdamW step must agree.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from tests.conftest import tiny_config

pytestmark = pytest.mark.slow


def synthetic_groups(vocab: int, num_groups: int = 4, g: int = 8, seed: int = 0):
    from mugrpo_async.algo import group_advantages
    from mugrpo_async.rollout.samples import Group

    rng = random.Random(seed)
    groups = []
    for k in range(num_groups):
        lengths = [rng.randint(1, 12) for _ in range(g)]
        rewards = [float(i % 2) for i in range(g)] if k % 2 == 0 else [float(rng.random() < 0.3) for _ in range(g)]
        adv = group_advantages(torch.tensor([rewards]))[0].tolist()
        groups.append(Group(
            prompt_id=f"p{k}", prompt_ids=[rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))], answer="0",
            responses=[[rng.randrange(3, vocab) for _ in range(n)] for n in lengths],
            behavior_logprobs=[[-rng.uniform(2.0, 6.0) for _ in range(n)] for n in lengths],
            rewards=rewards, advantages=adv, policy_version=0, finish_reasons=["stop"] * g,
        ))  # fmt: skip
    return groups


def one_update(ray, model, tmp, overrides, groups, options: list[dict] | None = None):
    """One sync-mode update on ``groups`` by fresh ranks (``options``: each rank's Ray options, default one CPU);
    its record and the exported weights."""
    from mugrpo_async.reporting.metrics import update_record
    from mugrpo_async.training.weights import unpack_state_dict

    base = ["trainer.lr=1e-3", "trainer.grad_clip=1e9", "schedule.groups_per_update=4"]
    cfg = tiny_config(model, tmp, base + overrides)
    ranks = _ranks(ray, cfg, options)
    ray.get([t.load_stage.remote(groups) for t in ranks])
    rec = update_record(ray.get([t.update.remote([0, 1, 2, 3]) for t in ranks]), update=1, policy_version=0)
    weights = unpack_state_dict(ray.get([t.export_weights.remote() for t in ranks])[0])
    for t in ranks:
        ray.kill(t)
    return rec, weights


@pytest.mark.parametrize("algo", ["loss_agg=seq_mean_token_mean", "loss_agg=token_mean", "name=m2po"])
def test_micro_batches_and_two_ranks_match_one_pass(ray_cluster, tiny_model, tmp_path, algo):
    from transformers import AutoConfig

    groups = synthetic_groups(AutoConfig.from_pretrained(tiny_model).vocab_size)
    agg = [f"algo.{algo}"] + (["algo.m2po_threshold=70.0"] if "m2po" in algo else [])
    ref, w_ref = one_update(ray_cluster, tiny_model, tmp_path, agg + ["trainer.micro_batch_size=32"], groups)
    variants = [
        ["trainer.micro_batch_size=5"],
        ["trainer.num_ranks=2", "trainer.micro_batch_size=8"],
        # token budget (rows balanced by tokens; packings of 10 and 9 passes, evened out) and chunked log-probs
        ["trainer.num_ranks=2", "trainer.max_tokens_per_micro_batch=30", "trainer.logprob_chunk_tokens=16"],
    ]
    assert ref["grad_norm"] > 0 and ref["nav_veto_frac"] >= 0
    for extra in variants:
        rec, w = one_update(ray_cluster, tiny_model, tmp_path, agg + extra, groups)
        print(f"{algo} {extra}: loss {rec['loss']:.6g} vs {ref['loss']:.6g}, "
              f"grad_norm {rec['grad_norm']:.6g} vs {ref['grad_norm']:.6g}")  # fmt: skip
        assert rec["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
        assert rec["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        for key in ("clip_frac", "nav_veto_frac", "ratio_mean", "reward_mean", "response_len_mean", "m2po_mask_frac"):
            if key not in ref:
                continue
            assert rec[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
        # Adam's first step is about lr * sign(g): where g is ~0, rounding can flip the sign, so a few
        # elements may differ by up to 2 * lr; everything else must agree to 1% of lr.
        diff = torch.cat([(w[name] - t).abs().flatten() for name, t in w_ref.items()])
        assert float(diff.max()) <= 2.5e-3
        assert float((diff > 1e-5).float().mean()) < 1e-3


def test_deepspeed_update_equals_plain_torch_adamw(ray_cluster, tiny_model, tmp_path):
    """The ZeRO engine's step is the same AdamW step a plain PyTorch loop takes on the same loss."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mugrpo_async.algo import policy_loss
    from mugrpo_async.training.batching import collate, flatten, token_logprobs

    groups = synthetic_groups(AutoConfig.from_pretrained(tiny_model).vocab_size, seed=3)
    rec, w_ds = one_update(ray_cluster, tiny_model, tmp_path, ["trainer.micro_batch_size=8"], groups)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
    batch = collate(flatten(groups), pad_id=0)
    mu_grpo = dict(clip_low=0.0, clip_high=5.0, nav_tau=1e-4, nav_scope="sequence")
    loss, _ = policy_loss(token_logprobs(model, batch), batch.behavior_logprobs, batch.advantages, batch.response_mask,
                          **mu_grpo)  # fmt: skip
    loss.backward()
    norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters()))
    opt.step()
    assert rec["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert rec["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    diff = torch.cat([(w_ds[n] - p.detach()).abs().flatten() for n, p in model.named_parameters()])
    moved = torch.cat([(w_ds[n] - w0).abs().flatten() for n, w0 in
                       AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters()])  # fmt: skip
    assert float(moved.mean()) > 1e-4  # the step really moved the weights
    assert float(diff.max()) <= 2.5e-3 and float((diff > 1e-5).float().mean()) < 1e-3


def test_drop_equal_reward_groups_renormalises_over_the_rest(ray_cluster, tiny_model, tmp_path):
    from dataclasses import replace

    from transformers import AutoConfig

    groups = synthetic_groups(AutoConfig.from_pretrained(tiny_model).vocab_size, seed=5)
    groups = [g if k % 2 == 0 else replace(g, rewards=[0.0] * 8, advantages=[0.0] * 8) for k, g in enumerate(groups)]
    kept, _ = one_update(ray_cluster, tiny_model, tmp_path, ["algo.drop_equal_reward_groups=true"], groups)
    full, _ = one_update(ray_cluster, tiny_model, tmp_path, [], groups)
    assert kept["groups_dropped"] == 2 and full["groups_dropped"] == 0
    # seq_mean_token_mean divides by N: 32 responses with the constant groups, 16 without them
    assert kept["loss"] == pytest.approx(2 * full["loss"], rel=1e-5)
    assert kept["grad_norm"] == pytest.approx(2 * full["grad_norm"], rel=1e-4)


def test_two_rank_checkpoint_restores_the_exact_optimizer_trajectory(ray_cluster, tiny_model, tmp_path):
    """save_state after one update, fresh ranks load it: the second update equals the uninterrupted one."""
    from transformers import AutoConfig

    from mugrpo_async.training.weights import unpack_state_dict

    groups = synthetic_groups(AutoConfig.from_pretrained(tiny_model).vocab_size, seed=7)
    cfg = tiny_config(tiny_model, tmp_path, ["trainer.lr=1e-3", "trainer.num_ranks=2", "trainer.micro_batch_size=8",
                                             "schedule.groups_per_update=2"])  # fmt: skip

    def ranks():
        out = _ranks(ray_cluster, cfg)
        ray_cluster.get([t.load_stage.remote(groups) for t in out])
        return out

    def weights(rs):
        return unpack_state_dict(ray_cluster.get([t.export_weights.remote() for t in rs])[0])

    first = ranks()
    ray_cluster.get([t.update.remote([0, 1]) for t in first])
    ckpt = tmp_path / "ckpt"
    (ckpt / "trainer").mkdir(parents=True)
    ray_cluster.get([t.save_state.remote(str(ckpt)) for t in first])
    ray_cluster.get([t.update.remote([2, 3]) for t in first])
    uninterrupted = weights(first)
    second = ranks()
    assert ray_cluster.get([t.load_state.remote(str(ckpt)) for t in second]) == [1, 1]
    ray_cluster.get([t.update.remote([2, 3]) for t in second])
    resumed = weights(second)
    for t in first + second:
        ray_cluster.kill(t)
    assert sorted(p.name for p in (ckpt / "trainer").iterdir()) == [
        "rank-0.json", "rank-0.safetensors", "rank-1.json", "rank-1.safetensors"]  # fmt: skip
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)


def _ranks(ray, cfg, options: list[dict] | None = None):
    """The config's trainer ranks, started as a run starts them (``options``: each rank's Ray options)."""
    from drivers.trainer_group import start_trainer_group

    return start_trainer_group(cfg, options or [{"num_cpus": 1}] * cfg.trainer.num_ranks)


def _exported(ray, ranks):
    from mugrpo_async.training.weights import unpack_state_dict

    return unpack_state_dict(ray.get([t.export_weights.remote() for t in ranks])[0])


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_a_non_finite_update_is_skipped_on_every_rank(ray_cluster, tiny_model, tmp_path, zero_stage):
    """A NaN in one rank's rows: no rank steps (weights and AdamW state untouched), both report the skip; the
    next healthy update steps. ZeRO-2 checks the gradient norm itself; stage 0 leaves it to the guard."""
    from transformers import AutoConfig

    from mugrpo_async.reporting.metrics import update_record

    groups = synthetic_groups(AutoConfig.from_pretrained(tiny_model).vocab_size, seed=11)
    poisoned = copy.deepcopy(groups)
    poisoned[3].advantages[0] = float("nan")  # rank 1's share (groups 2 and 3 of 4)
    overrides = ["trainer.lr=1e-3", "trainer.num_ranks=2", "trainer.micro_batch_size=8", "schedule.groups_per_update=4"]
    cfg = tiny_config(tiny_model, tmp_path, [*overrides, f"trainer.zero_stage={zero_stage}"])
    ranks = _ranks(ray_cluster, cfg)
    before = _exported(ray_cluster, ranks)
    bad = ray_cluster.get([t.update_groups.remote(poisoned) for t in ranks])
    assert [m["nonfinite_skipped"] for m in bad] == [1.0, 1.0]
    assert update_record(bad, update=1, policy_version=0)["nonfinite_skipped"] == 1
    after_bad = _exported(ray_cluster, ranks)
    assert all(torch.equal(before[k], after_bad[k]) for k in before)
    good = ray_cluster.get([t.update_groups.remote(groups) for t in ranks])
    assert [m["nonfinite_skipped"] for m in good] == [0.0, 0.0]
    after_good = _exported(ray_cluster, ranks)
    assert max(float((after_good[k] - before[k]).abs().max()) for k in before) > 1e-4
    for t in ranks:
        ray_cluster.kill(t)


def test_lag0_mismatch_and_truncated_is_at_a_temperature(ray_cluster, tiny_model, tmp_path):
    """At temperature 0.7 the trainer's log-probs are log softmax(logits / 0.7): the mismatch it reports on lag-0
    rows, and the truncated importance weights of a staged update (2 ranks sharing the stage's pass), equal an
    independent transformers computation against the stored behaviour log-probs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mugrpo_async.reporting.metrics import update_record
    from mugrpo_async.training.batching import collate, flatten

    groups = synthetic_groups(AutoConfig.from_pretrained(tiny_model).vocab_size, seed=5)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    batch = collate(flatten(groups), pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    pos = (batch.response_index - 1).clamp(min=0)
    logp = torch.log_softmax(logits / 0.7, dim=-1)  # (N, S, V)
    lp = logp.gather(1, pos.unsqueeze(-1).expand(-1, -1, logp.shape[-1]))
    lp = lp.gather(-1, batch.input_ids.gather(1, batch.response_index).unsqueeze(-1)).squeeze(-1)  # (N, T)
    d = (lp - batch.behavior_logprobs)[batch.response_mask]
    cfg = tiny_config(tiny_model, tmp_path, ["rollout.temperature=0.7", "trainer.num_ranks=2", "algo.tis_cap=2.0",
                                             "trainer.micro_batch_size=8", "schedule.groups_per_update=4"])  # fmt: skip
    ranks = _ranks(ray_cluster, cfg)
    ray_cluster.get([t.load_stage.remote(groups) for t in ranks])
    first = update_record(ray_cluster.get([t.update.remote([0, 1, 2, 3]) for t in ranks]), 1, 0)
    assert first["mismatch_tokens"] == len(d)
    assert first["mismatch_logprob_abs_mean"] == pytest.approx(float(d.abs().mean()), rel=1e-4)
    assert first["mismatch_logprob_abs_max"] == pytest.approx(float(d.abs().max()), rel=1e-4)
    assert first["mismatch_kl"] == pytest.approx(float((torch.expm1(d) - d).mean()), rel=1e-4)
    w = torch.exp(d).clamp(max=2.0)
    assert first["tis_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-4)
    assert first["tis_truncated_frac"] == pytest.approx(float((w >= 2.0).float().mean()))
    # Update 2 on the same (version 0) groups: lag 1, no mismatch measured; the stage's weights are reused.
    second = update_record(ray_cluster.get([t.update.remote([0, 1, 2, 3]) for t in ranks]), 2, 0)
    assert "mismatch_tokens" not in second and second["tis_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-4)
    for t in ranks:
        ray_cluster.kill(t)


def test_a_publish_overlaps_the_next_update_and_holds_its_own_version(ray_cluster, tiny_model, tmp_path):
    """The async publish path: every rank packs right behind update 1 (ZeRO-3: bucket by bucket, each gathered on
    both ranks), rank 0 copies the export into the object store in its publish thread while update 2 runs; the
    object holds update 1's weights (the double buffer), not update 2's. (ZeRO-2 runs it in every async test.)"""
    from transformers import AutoConfig

    from mugrpo_async.training.weights import unpack_state_dict

    groups = synthetic_groups(AutoConfig.from_pretrained(tiny_model).vocab_size, seed=5)
    cfg = tiny_config(tiny_model, tmp_path, ["trainer.lr=1e-3", "trainer.num_ranks=2", "trainer.micro_batch_size=8",
                                             "schedule.groups_per_update=4", "trainer.zero_stage=3",
                                             "weight_sync.bucket_mb=0.05"])  # fmt: skip
    ranks = _ranks(ray_cluster, cfg)
    ray_cluster.get([t.load_stage.remote(groups) for t in ranks])
    ray_cluster.get([t.update.remote([0, 1, 2, 3]) for t in ranks])
    after_1 = _exported(ray_cluster, ranks)
    packs = [t.pack_weights.remote() for t in ranks]
    taken = ranks[0].take_weights.remote()
    second = [t.update.remote([3, 2, 1, 0]) for t in ranks]  # submitted before the publish is stored
    info, other = ray_cluster.get(packs)
    ref, t_store = ray_cluster.get(taken)
    ray_cluster.get(second)
    published, after_2 = ray_cluster.get(ref), _exported(ray_cluster, ranks)
    assert other is None and info["version"] == published.version == 1 and info["t_pack_s"] > 0
    assert info["nbytes"] == published.nbytes and t_store > 0
    weights = unpack_state_dict(published)
    assert all(torch.equal(weights[k], after_1[k]) for k in after_1)
    assert any(not torch.equal(after_2[k], after_1[k]) for k in after_1)  # update 2 moved them
    for _ in range(3):  # more publishes than slots: each one's take frees its slot
        packs = [t.pack_weights.remote() for t in ranks]
        ref, _ = ray_cluster.get(ranks[0].take_weights.remote())
        assert ray_cluster.get(ref).version == 2
    for t in ranks:
        ray_cluster.kill(t)
