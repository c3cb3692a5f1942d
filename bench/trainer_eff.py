"""Benchmark 5, trainer efficiency: the DeepSpeed trainer step against plain PyTorch on the same batch.

DeepSpeed side: the real ``TrainerRank`` actor (ZeRO-2, one rank, torch AdamW), ``update_groups`` on a
minibatch of B_mini = 16 groups x G = 8 responses (micro-batches of 64, as in the tiny config); its
step time is the actor's own ``t_step_s`` (forward, backward, optimizer step; not the collation).
Plain side: a Ray actor with the same CPU reservation and thread count that loads the same model
folder and runs the same micro-batches through ``token_logprobs`` + ``policy_loss`` + backward, gradient
clipping and ``torch.optim.AdamW.step``. The two are called alternately, so both see the same load;
the overhead is the median of the per-pair step-time ratios. Groups are synthetic (task prompts,
random response tokens of 6-16 tokens, behaviour log-probs near the model's).

    .venv/bin/python -m bench.run --only 5 [--smoke]
"""

from __future__ import annotations

import random
import statistics
import time

import ray

from bench.cluster import local_ray, prompts, release, tiny_config, trainer_rank
from bench.common import Row, Section, bench_command, md_table
from bench.weight_sync import model_folder


@ray.remote
class PlainTrainer:
    """The same model, loss and optimizer in plain PyTorch (no DeepSpeed), with a trainer rank's threads."""

    def __init__(self, cfg: dict):
        import torch
        from transformers import AutoModelForCausalLM

        from mugrpo_async.config import Config

        self.cfg = Config.model_validate(cfg)
        torch.set_num_threads(self.cfg.trainer_threads)  # what the DeepSpeed rank uses
        torch.manual_seed(self.cfg.run.seed)
        self.model = AutoModelForCausalLM.from_pretrained(self.cfg.model.path, dtype=torch.float32)
        self.ref = None  # the reference policy of the KL penalty, as the trainer loads it
        if self.cfg.algo.kl_coef > 0:
            self.ref = AutoModelForCausalLM.from_pretrained(self.cfg.model.path, dtype=torch.float32).eval()
        t = self.cfg.trainer
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay
        )

    def step(self, groups: list) -> dict:
        """One update on ``groups``; returns the step seconds (forward, backward, clip, AdamW)."""
        import torch

        from mugrpo_async.algo import LossSpec, policy_loss
        from mugrpo_async.training.batching import token_logprobs
        from mugrpo_async.training.minibatch import micro_batches, rank_share

        # The trainer's own loss spec and minibatch split (one rank): the same options as TrainerRank, dual clip,
        # M2PO (per micro-batch here) and KL included.
        spec, T = LossSpec.from_config(self.cfg.algo), self.cfg.rollout.temperature
        share = rank_share(groups, 0, 1, self.cfg.algo.drop_equal_reward_groups)
        t0 = time.perf_counter()
        self.model.train()
        for mb in micro_batches(share.batch, self.cfg.trainer.micro_batch_size):
            logp = token_logprobs(self.model, mb, T)
            ref = None
            if self.ref is not None:
                with torch.no_grad():
                    ref = token_logprobs(self.ref, mb, T)
            loss, _ = policy_loss(logp, mb.behavior_logprobs, mb.advantages, mb.response_mask, spec,
                                  ref_logprobs=ref, **share.totals)  # fmt: skip
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"t_step_s": time.perf_counter() - t0}


def synthetic_groups(cfg, n_groups: int, seed: int = 0) -> list:
    """``n_groups`` groups of the task's prompts with random responses (6-16 tokens) and advantages."""
    import torch

    from mugrpo_async.algo import group_advantages
    from mugrpo_async.rollout.samples import Group

    rng = random.Random(seed)
    G, out = cfg.rollout.group_size, []
    for p in prompts(cfg)[:n_groups]:
        resp = [[rng.randrange(2, 258) for _ in range(rng.randint(6, 16))] for _ in range(G)]
        lps = [[-rng.uniform(0.05, 3.0) for _ in r] for r in resp]
        rewards = [float(rng.random() < 0.4) for _ in range(G)]
        adv = group_advantages(torch.tensor([rewards]))[0].tolist()
        out.append(Group(p["prompt_id"], p["prompt_ids"], p["answer"], resp, lps, rewards, adv, 0, ["stop"] * G))
    return out


def measure(folder, repeats: int) -> dict:
    """Alternate DeepSpeed and plain steps on the same minibatch; per-pair step times."""
    cfg = tiny_config(model=folder)
    groups = synthetic_groups(cfg, cfg.schedule.groups_per_update)
    ref = ray.put(groups)
    ds, plain = trainer_rank(cfg), PlainTrainer.options(num_cpus=cfg.trainer.cpus_per_rank).remote(cfg.to_dict())
    pairs = []
    try:
        for k in range(repeats + 3):
            d = ray.get(ds.update_groups.remote(ref))["t_step_s"]
            p = ray.get(plain.step.remote(ref))["t_step_s"]
            if k >= 3:  # warm-up
                pairs.append((d, p))
    finally:
        release("trainer", cfg, ds)
        ray.kill(plain)
    tokens = sum(len(r) + len(g.prompt_ids) for g in groups for r in g.responses)
    t_ds, t_plain = (statistics.median(x[i] for x in pairs) for i in (0, 1))
    return {"tokens": tokens, "ds_s": t_ds, "plain_s": t_plain, "overhead": statistics.median(d / p for d, p in pairs)}


def run(smoke: bool) -> Section:
    names, repeats = (["tiny-140k"], 3) if smoke else (["tiny-140k", "qwen2-4m"], 30)
    results = {}
    with local_ray():
        for name in names:
            results[name] = measure(model_folder(name), repeats)
    cmd = bench_command(5, smoke)
    r = results["tiny-140k"]
    over = r["overhead"] - 1
    sec = Section(5, "Trainer efficiency: DeepSpeed step vs plain PyTorch, same model and batch")
    sec.rows = [
        Row(
            "DeepSpeed step time / plain PyTorch step time - 1, tiny model",
            "<= 10%",
            f"{over:+.1%}",
            over <= 0.10,
            cmd,
            "DeepSpeed's fixed per-step work (ZeRO gradient partition copies, "
            "its own norm and clipping, bookkeeping) against a step of only tens of milliseconds",
        )
    ]
    for name in names[1:]:
        sec.rows.append(Row(f"the same, {name}", "(context)", f"{results[name]['overhead'] - 1:+.1%}", None, cmd))
    table = [
        [
            n,
            x["tokens"],
            f"{x['ds_s'] * 1e3:.1f}",
            f"{x['plain_s'] * 1e3:.1f}",
            f"{x['tokens'] / x['ds_s']:.0f}",
            f"{x['tokens'] / x['plain_s']:.0f}",
            f"{x['overhead'] - 1:+.1%}",
        ]
        for n, x in results.items()
    ]
    sec.details = [
        f"Median of {repeats} alternating pairs after 3 warm-up pairs; tokens = prompt + response tokens per update "
        "(128 responses).",
        md_table(
            ["model", "tokens/update", "DeepSpeed ms", "plain ms", "DeepSpeed tok/s", "plain tok/s", "overhead"], table
        ),
    ]
    sec.data = results
    return sec
