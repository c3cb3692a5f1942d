"""Trainer rank: a Ray actor holding one DeepSpeed ZeRO data-parallel rank.

Each update gets B_mini groups (indices into the stage dataset this rank holds); rank r takes its
contiguous share of the B_mini * G responses, runs ``micro_batches_per_rank`` forward/backward passes
and one optimizer step. The loss of every micro-batch is normalised by the whole minibatch's totals
(N responses, sum_i T_i tokens) and DeepSpeed's own averaging is undone (``scale_wrt_gas=False``,
times ``world_size`` for the data-parallel mean), so the summed gradient equals one pass over the
whole minibatch.

Idle accounting: ``t_wait_s`` is the time from the end of the previous step to the start of this
one's forward pass (waiting for work and assembling the minibatch); ``trainer_idle_ratio`` is the
cumulative wait over the cumulative wall time since training began (``start_clock``).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import ray

from mugrpo_async.config import Config

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[1]


def deepspeed_config(cfg: Config) -> dict:
    """The DeepSpeed config for one rank, derived from the typed config."""
    t = cfg.trainer
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": cfg.micro_batches_per_rank,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "fp16": {"enabled": cfg.model.dtype == "float16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


@ray.remote
class TrainerRank:
    """One DeepSpeed rank over the transformers model, with the mu-GRPO loss."""

    def __init__(self, cfg: dict, rank: int, world_size: int, master_addr: str, master_port: int):
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
        )  # fmt: skip
        # DeepSpeed JIT-compiles its CPU shared-memory allreduce on first use; keep the build.
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".cache" / "torch_extensions"))
        import deepspeed
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no "Writing model shards" bar per checkpoint
        self.cfg = Config.model_validate(cfg)
        self.rank, self.world_size = rank, world_size
        torch.manual_seed(self.cfg.run.seed)
        torch.set_num_threads(self.cfg.trainer_threads)
        deepspeed.init_distributed(verbose=False)
        dtype = getattr(torch, self.cfg.model.dtype)
        model = AutoModelForCausalLM.from_pretrained(
            self.cfg.model.path, dtype=dtype, trust_remote_code=self.cfg.model.trust_remote_code
        )
        t = self.cfg.trainer
        if t.gradient_checkpointing:  # activations of 8k-token responses do not fit otherwise
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(self.cfg))
        self.ref_model = None
        if self.cfg.algo.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(self.cfg.model.path, dtype=dtype).eval()
        self.stage: list = []
        self.num_updates = 0
        self.start_clock()

    def __repr__(self) -> str:
        # Ray records an actor's repr once, after construction (the Actors view and log prefixes show
        # it); the live idle ratio, lag and update count are the mugrpo_* gauges.
        return f"TrainerRank(run={self.cfg.run.name}, rank={self.rank}/{self.world_size})"

    def start_clock(self) -> None:
        """Start idle accounting now (when training begins, not when the actor was created)."""
        self.t_last_end = time.perf_counter()
        self.cum_wait = self.cum_busy = 0.0

    def load_stage(self, groups: list) -> int:
        """Hold a stage's rollout dataset (a list of Groups) for the following updates."""
        self.stage = groups
        return len(groups)

    def _my_rows(self, groups: list) -> tuple[list, list]:
        """(this rank's contiguous share of the (group, response) rows, by length; all rows)."""
        from mugrpo_async.training.batching import by_length, flatten

        rows = flatten(groups)
        per = len(rows) // self.world_size
        return by_length(rows[self.rank * per : (self.rank + 1) * per]), rows

    def update(self, indices: list[int]) -> dict:
        """Sync mode: one optimizer update on the stage groups at ``indices``; this rank's metrics."""
        return self.update_groups([self.stage[i] for i in indices])

    def update_groups(self, groups: list) -> dict:
        """One optimizer update on ``groups`` (the minibatch, the same on every rank); this rank's metrics."""
        import torch

        from mugrpo_async.algo import merge_metrics, nonconstant_groups
        from mugrpo_async.training.batching import collate

        mine, rows = self._my_rows(groups)
        batch = collate(mine, pad_id=0)
        kept = len(groups)
        if self.cfg.algo.drop_equal_reward_groups:  # equal rewards: A = 0; drop them from every total too
            signal = nonconstant_groups(torch.tensor([g.rewards for g in groups])).tolist()
            live = {id(g) for g, s in zip(groups, signal) if s}
            kept = len(live)
            rows = [(g, i) for g, i in rows if id(g) in live]
            batch.response_mask &= torch.tensor([id(g) in live for g, _ in mine]).unsqueeze(1)
        totals = {"num_sequences": max(len(rows), 1), "num_tokens": sum(len(g.responses[i]) for g, i in rows)}
        t1 = time.perf_counter()  # waiting and assembling end here; the step begins
        self.engine.train()
        mbs = self.cfg.trainer.micro_batch_size
        micro = [batch.slice(s, min(s + mbs, len(batch))) for s in range(0, len(batch), mbs)]
        keeps = self._m2po_keeps(micro) if self.cfg.algo.m2po_threshold is not None else [None] * len(micro)
        parts = [self._micro_step(mb, totals, keep) for mb, keep in zip(micro, keeps)]
        grad_norm = self.engine.get_global_grad_norm()
        self.num_updates += 1
        t2 = time.perf_counter()
        wait, busy = t1 - self.t_last_end, t2 - t1
        self.cum_wait += wait
        self.cum_busy += busy
        self.t_last_end = t2
        m = merge_metrics(parts)
        lags = (self.num_updates - 1) - batch.policy_versions
        self._export_gauges(lags)
        m.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            reward_sum=float(batch.rewards.sum()), response_len_sum=float(batch.response_mask.sum()),
            lag_sum=float(lags.sum()), lag_max=int(lags.max()), policy_version_min=int(batch.policy_versions.min()),
            t_wait_s=wait, t_step_s=busy, cum_wait_s=self.cum_wait, cum_busy_s=self.cum_busy,
            loss=float(sum(p["loss"] for p in parts)), num_rows=len(batch),
            groups_dropped=len(groups) - kept,
        )  # fmt: skip
        return m

    def _export_gauges(self, lags) -> None:
        """Trainer idle ratio, lag and update count as ray.util.metrics gauges (rank 0)."""
        if self.rank != 0:
            return
        if not hasattr(self, "_gauges"):
            from actors.gauges import make_gauges

            names = {"trainer_idle_ratio": "cumulative wait / wall", "lag_mean": "mean update - policy version",
                     "lag_max": "max update - policy version", "trainer_updates": "optimizer updates done"}  # fmt: skip
            self._gauges = make_gauges(names, self.cfg.run.name)
        idle = self.cum_wait / max(self.cum_wait + self.cum_busy, 1e-9)
        values = {"trainer_idle_ratio": idle, "lag_mean": float(lags.float().mean()), "lag_max": float(lags.max()),
                  "trainer_updates": self.num_updates}  # fmt: skip
        for k, v in values.items():
            self._gauges[k].set(v)

    def _m2po_keeps(self, micro: list) -> list:
        """M2PO keep-masks over the whole minibatch (all micro-batches of all ranks), one per micro-batch.

        A no-grad pass gives every response token's log ratio; the ranks' values are gathered so that
        `m2po_mask` sees exactly the tokens of one full-minibatch pass.
        """
        import torch
        import torch.distributed as dist

        from mugrpo_async.algo import m2po_mask
        from mugrpo_async.training.batching import token_logprobs

        with torch.no_grad():
            ratios = [(token_logprobs(self.engine, mb) - mb.behavior_logprobs)[mb.response_mask] for mb in micro]
        local = torch.cat(ratios) if ratios else torch.zeros(0)
        pieces = [local]
        if self.world_size > 1:
            pieces = [None] * self.world_size
            dist.all_gather_object(pieces, local)
        everything = torch.cat(pieces).view(1, -1)
        keep = m2po_mask(everything, torch.ones_like(everything, dtype=torch.bool), self.cfg.algo.m2po_threshold)[0]
        start = sum(len(p) for p in pieces[: self.rank]) if self.world_size > 1 else 0
        out = []
        for mb, r in zip(micro, ratios):
            k = torch.zeros_like(mb.response_mask)
            k[mb.response_mask] = keep[start : start + len(r)]
            start += len(r)
            out.append(k)
        return out

    def _micro_step(self, mb, totals: dict, m2po_keep=None) -> dict:
        import torch

        from mugrpo_async.algo import policy_loss
        from mugrpo_async.training.batching import token_logprobs

        a = self.cfg.algo
        logp = token_logprobs(self.engine, mb)
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = token_logprobs(self.ref_model, mb)
        loss, metrics = policy_loss(
            logp, mb.behavior_logprobs, mb.advantages, mb.response_mask,
            clip_low=a.clip_low, clip_high=a.clip_high, nav_tau=a.nav_tau, nav_scope=a.nav_scope,
            loss_agg=a.loss_agg, dual_clip_c=a.dual_clip_c, m2po_threshold=a.m2po_threshold,
            kl_coef=a.kl_coef, ref_logprobs=ref, m2po_keep=m2po_keep, **totals,
        )  # fmt: skip
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
        self.engine.step()
        return metrics

    def logprobs(self, groups: list) -> list[list[list[float]]]:
        """The current policy's log-probs of every response token, per group and response."""
        import torch

        from mugrpo_async.training.batching import collate, flatten

        rows = flatten(groups)
        self.engine.eval()
        with torch.no_grad():
            lp = _chunked_logprobs(self.engine, collate(rows, pad_id=0), self.cfg.trainer.micro_batch_size)
        out, k = [], 0
        for g in groups:
            out.append([lp[k + i][: len(g.responses[i])] for i in range(g.group_size)])
            k += g.group_size
        return out

    def full_state(self) -> dict:
        """Full weights on CPU (gathered under ZeRO-3; every rank must call it)."""
        import deepspeed

        params = dict(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), enabled=self.cfg.trainer.zero_stage == 3):
            return {k: v.detach().to("cpu", copy=True) for k, v in params.items()}

    def export_weights(self):
        """PackedWeights of the current policy on rank 0 (None on other ranks); version = update count.

        The parameters are packed straight into the one buffer (one copy; no intermediate full state),
        inside the ZeRO-3 gather when there is one (every rank must call it). The buffer is reused
        from one export to the next: Ray has copied the returned one into its object store by then.
        """
        import deepspeed

        from mugrpo_async.training.weights import pack_state_dict

        params = dict(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), enabled=self.cfg.trainer.zero_stage == 3):
            if self.rank != 0:
                return None
            state = {k: v.detach() for k, v in params.items()}
            packed = pack_state_dict(state, self.num_updates, out=getattr(self, "_export_buffer", None))
        self._export_buffer = packed.buffer
        return packed

    def save_state(self, folder: str) -> None:
        """Write this rank's share of a checkpoint into ``folder`` (every rank must call it).

        Rank 0 writes the policy as HF files; every rank writes ``trainer/rank-<r>``: its optimizer
        state (ZeRO partitions, fp32 master weights), torch RNG state and update count, as
        safetensors + JSON (no pickle).
        """
        import torch

        from mugrpo_async.checkpoints.model_folder import write_hf_files
        from mugrpo_async.checkpoints.state_io import save_tree

        state = self.full_state()
        if self.rank == 0:
            write_hf_files(self.engine.module, state, self.cfg.model.path, folder)
        tree = {"optimizer": self.engine.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                "num_updates": self.num_updates, "world_size": self.world_size,
                "zero_stage": self.cfg.trainer.zero_stage, "cum_wait_s": self.cum_wait,
                "cum_busy_s": self.cum_busy}  # fmt: skip
        save_tree(tree, Path(folder) / "trainer" / f"rank-{self.rank}")

    def load_state(self, folder: str) -> int:
        """Restore weights, optimizer, RNG and update count from a checkpoint; returns the update count."""
        import deepspeed
        import torch
        from safetensors.torch import load_file

        from mugrpo_async.checkpoints.state_io import StateFormatError, load_tree

        folder = Path(folder)
        weights: dict = {}
        for f in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        params = dict(self.engine.module.named_parameters())
        missing = sorted(set(params) - set(weights))
        if missing:
            raise StateFormatError(f"{folder}: weights missing for {missing[:3]}")
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0,
                                               enabled=self.cfg.trainer.zero_stage == 3):  # fmt: skip
            with torch.no_grad():
                for name, p in params.items():
                    p.data.copy_(weights[name].to(p.dtype))
        opt = self.engine.optimizer
        tree = load_tree(folder / "trainer" / f"rank-{self.rank}", template={"optimizer": opt.state_dict()})
        saved = (tree["world_size"], tree["zero_stage"])
        if saved != (self.world_size, self.cfg.trainer.zero_stage):
            raise StateFormatError(f"{folder}: written by {saved[0]} ranks at ZeRO stage {saved[1]}; this run has "
                                   f"{self.world_size} at stage {self.cfg.trainer.zero_stage}")  # fmt: skip
        if not isinstance(opt, torch.optim.Optimizer):  # DeepSpeed's ZeRO/bf16 wrappers: one state per rank
            states = [None] * self.world_size
            states[self.rank] = tree["optimizer"]
            opt.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)
        else:
            opt.load_state_dict(tree["optimizer"])
        torch.set_rng_state(tree["torch_rng"])
        self.num_updates = int(tree["num_updates"])
        self.cum_wait, self.cum_busy = float(tree["cum_wait_s"]), float(tree["cum_busy_s"])  # idle ratio continues
        self.t_last_end = time.perf_counter()
        return self.num_updates

    def save_hf(self, path: str) -> str | None:
        """Write the policy as an HF folder (safetensors) at ``path`` atomically (rank 0 writes)."""
        from mugrpo_async.checkpoints.model_folder import save_hf_folder

        state = self.full_state()
        if self.rank != 0:
            return None
        return str(save_hf_folder(self.engine.module, state, self.cfg.model.path, path))


def _chunked_logprobs(model, batch, size: int) -> list[list[float]]:
    from mugrpo_async.training.batching import token_logprobs

    out = []
    for start in range(0, len(batch), size):
        mb = batch.slice(start, min(start + size, len(batch)))
        out.extend(token_logprobs(model, mb).tolist())
    return out
