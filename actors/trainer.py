"""Trainer rank: a Ray actor holding one DeepSpeed ZeRO data-parallel rank, a thin adapter over the library.

The update itself (minibatch share, micro-batches at the sampling temperature, the loss, the guarded step, the
lag-0 mismatch) is `mugrpo_async.training.update.PolicyUpdater`; this actor builds the DeepSpeed engine around the
client optimizer and its non-finite guard, holds a sync stage, exports weights, writes and restores checkpoints,
and sets the rank-0 gauges.

Starting a group of ranks takes three steps (`drivers.trainer_group.start_trainer_group`): construct every rank
(cheap: it finds its device, the GPU Ray assigned it, and sets its environment), ask rank 0 for the rendezvous
address of its own node (:meth:`TrainerRank.rendezvous_address`), then :meth:`TrainerRank.setup` on every rank at
once: the process group, the model, the optimizer and the DeepSpeed engine.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from pathlib import Path

import ray

from actors.quiet import quiet_process
from mugrpo_async.config import Config

REPO_ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger(__name__)


@ray.remote(concurrency_groups={"publish": 1})
class TrainerRank:
    """One DeepSpeed rank over the transformers model, with the mu-GRPO loss."""

    def __init__(self, cfg: dict, rank: int, world_size: int):
        import torch

        from mugrpo_async.training.distributed import rank_device, rank_env
        from mugrpo_async.weight_sync.exports import ExportSlots

        self.cfg = c = Config.model_validate(cfg)
        quiet_process(c.logging.level)
        self.rank, self.world_size = rank, world_size
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.device = rank_device(ray.get_gpu_ids(), visible, torch.cuda.is_available())
        os.environ.update(rank_env(rank, world_size, self.device))
        # DeepSpeed JIT-compiles its CPU shared-memory allreduce on first use; keep the build.
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".cache" / "torch_extensions"))
        self.engine = self.updater = self.master = None
        self.exports = ExportSlots()  # rank 0's packed weights between pack_weights and take_weights
        self.stage, self.stage_logprobs, self.num_skipped, self._gauges = [], None, 0, None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a port free on it: where every rank meets (asked of rank 0)."""
        from mugrpo_async.training.distributed import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> dict:
        """Join the process group at rank 0's address (every rank at once), then build the model, the optimizer
        with its non-finite guard and the DeepSpeed engine on this rank's device; returns :meth:`device_info`."""
        import deepspeed
        import torch
        from transformers.utils import logging as hf_logging

        from mugrpo_async.models.loading import load_causal_lm
        from mugrpo_async.training.deepspeed_config import deepspeed_config
        from mugrpo_async.training.distributed import all_ranks_agree
        from mugrpo_async.training.guard import NonFiniteGuard
        from mugrpo_async.training.lr_schedule import build_lr_scheduler
        from mugrpo_async.training.update import PolicyUpdater

        c, t = self.cfg, self.cfg.trainer
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        self.master = (master_addr, int(master_port))
        hf_logging.disable_progress_bar()  # no "Writing model shards" bar per checkpoint
        if self.device.on_cuda:
            torch.cuda.set_device(self.device.local_rank)
        torch.manual_seed(c.run.seed)
        torch.set_num_threads(c.trainer_threads)
        with contextlib.redirect_stdout(sys.stdout if c.logging.level == "DEBUG" else io.StringIO()):
            deepspeed.init_distributed(dist_backend=self.device.backend, verbose=False)  # prints its op builds
        model = load_causal_lm(c.model)
        if t.gradient_checkpointing:  # activations of 8k-token responses do not fit otherwise
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        guard = NonFiniteGuard(opt, all_ranks_agree)  # the scheduler then tracks the guarded step
        sched = build_lr_scheduler(opt, t, c.schedule.total_updates)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(c),
                                               lr_scheduler=sched)  # fmt: skip
        ref = load_causal_lm(c.model) if c.algo.kl_coef > 0 else None  # moved to the engine's device
        self.updater = PolicyUpdater(self.engine, c, self.rank, self.world_size, guard, ref)
        return self.device_info()

    def device_info(self) -> dict:
        """Where this rank runs: node, Ray GPU ids, CUDA_VISIBLE_DEVICES, LOCAL_RANK, backend, device, the
        rendezvous address, and the peak memory the device has held (bytes; CUDA only, else None)."""
        import torch
        import torch.distributed as dist

        cuda = self.device.on_cuda and torch.cuda.is_available()
        return {
            "rank": self.rank, "node_ip": ray.util.get_node_ip_address(), "gpu_ids": list(self.device.gpu_ids),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "local_rank": os.environ["LOCAL_RANK"],
            "backend": dist.get_backend() if dist.is_initialized() else None, "device": str(self.device.device),
            "engine_device": None if self.engine is None else str(self.engine.device), "master": self.master,
            "peak_device_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        }  # fmt: skip

    def __repr__(self) -> str:
        # Ray records an actor's repr once, after construction (the Actors view and log prefixes show
        # it); the live idle ratio, lag and update count are the mugrpo_* gauges.
        return f"TrainerRank(run={self.cfg.run.name}, rank={self.rank}/{self.world_size})"

    def start_clock(self) -> None:
        """Start idle accounting now (when training begins, not when the actor was created)."""
        self.updater.clock.restart()

    def offload_states(self) -> bool:
        """Colocated devices, before the engine wakes: move the optimizer states, fp32 master weights and gradients
        to host memory (DeepSpeed's ``offload_states`` of its ZeRO 1-3 optimizer; the model's own weights stay).
        Returns whether anything moved: a ZeRO-0 engine has no such offload, and on a CPU device the states
        already live in host memory; both are said once in the log and the call does nothing."""
        from mugrpo_async.colocation import offload_unsupported

        why = offload_unsupported(self.cfg.trainer.zero_stage, self.device.on_cuda,
                                  hasattr(self.engine.optimizer, "offload_states"))  # fmt: skip
        if why:
            if not getattr(self, "_offload_noted", False) and self.rank == 0:
                log.warning("trainer states stay on the device between phases: %s", why)
            self._offload_noted = True
            return False
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

        states = [S.optim_states, S.hp_params, S.lp_grads, S.contiguous_grad_buffer]
        self.engine.offload_states(include=states, device=OffloadDeviceEnum.cpu, pin_memory=True)
        self._offloaded = True
        return True

    def reload_states(self) -> bool:
        """Colocated devices, after the engine sleeps: bring back what :meth:`offload_states` moved (nothing when it
        moved nothing)."""
        if not getattr(self, "_offloaded", False):
            return False
        self.engine.reload_states()
        self._offloaded = False
        return True

    def load_stage(self, stage: list) -> int:
        """Hold a stage for the following updates: its groups, or (the staged driver's way) a
        `~mugrpo_async.rollout.shards.GroupRef` per group, whose minibatches each update then reads from the shards:
        a rank holds the stage's index and one minibatch, not the stage.

        With truncated importance sampling the trainer holds the behaviour weights now (the stage was generated by
        the weights it exported), so its own log-probs of every response are computed here, once, the ranks
        splitting the groups (read a minibatch's worth at a time) and sharing the results as float32 arrays.
        """
        from mugrpo_async.rollout.shards import resolve
        from mugrpo_async.training.distributed import gather_objects, strided_share, unstride

        self.stage, self.stage_logprobs = stage, None
        if self.updater.spec.tis_cap is not None:
            share, step = strided_share(stage, self.rank, self.world_size), self.cfg.schedule.groups_per_update
            mine = [lps for k in range(0, len(share), step) for lps in self.logprobs(resolve(share[k : k + step]))]
            self.stage_logprobs = unstride(gather_objects(mine), len(stage))
        return len(stage)

    def update(self, indices: list[int]) -> dict:
        """Sync mode: one optimizer update on the stage groups at ``indices``; this rank's metrics."""
        from mugrpo_async.rollout.shards import resolve

        old = None if self.stage_logprobs is None else [self.stage_logprobs[i] for i in indices]
        lr = self.engine.get_lr()[0]  # the lr this update steps with (the scheduler moves at its step)
        return self._gauged(self.updater.update(resolve([self.stage[i] for i in indices]), old) | {"lr": lr})

    def update_groups(self, groups: list) -> dict:
        """One optimizer update on ``groups`` (the minibatch, the same on every rank); this rank's metrics."""
        lr = self.engine.get_lr()[0]
        return self._gauged(self.updater.update(groups) | {"lr": lr})

    def logprobs(self, groups: list) -> list:
        """The current policy's log-probs of every response token (sampling distribution), per group and response
        (float32 arrays)."""
        return self.updater.logprobs(groups)

    def _gauged(self, m: dict) -> dict:
        """Rank 0 sets the ray.util.metrics gauges: idle ratio, lag, updates, skipped updates, mismatch."""
        from actors.gauges import TRAINER_GAUGES, make_gauges
        from mugrpo_async.algo import mismatch_metrics

        self.num_skipped += int(m["nonfinite_skipped"])
        if self.rank == 0:
            self._gauges = self._gauges or make_gauges(TRAINER_GAUGES, self.cfg.run.name)
            values = {"trainer_idle_ratio": self.updater.clock.idle_ratio, "lag_mean": m["lag_sum"] / m["num_rows"],
                      "lag_max": m["lag_max"], "trainer_updates": self.updater.num_updates,
                      "nonfinite_skipped": self.num_skipped, **mismatch_metrics(m)}  # fmt: skip
            for k, v in values.items():
                if k in self._gauges:
                    self._gauges[k].set(v)
        return m

    def _gathered(self, modifier_rank: int | None = None):
        """(parameters by name, a context manager that gathers them under ZeRO-3; every rank must enter it);
        with ``modifier_rank``, that rank's changes are scattered back on exit."""
        import deepspeed

        params = dict(self.engine.module.named_parameters())
        return params, deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=modifier_rank,
                                                         enabled=self.cfg.trainer.zero_stage == 3)  # fmt: skip

    def full_state(self) -> dict:
        """Full weights on CPU (gathered under ZeRO-3; every rank must call it)."""
        params, gathered = self._gathered()
        with gathered:
            return {k: v.detach().to("cpu", copy=True) for k, v in params.items()}

    def export_weights(self):
        """PackedWeights of the current policy on rank 0 (None elsewhere; every rank must call it); version =
        update count. Packed into one buffer reused from export to export (Ray has copied the previous one into
        its object store by then). Weights that are not finite never leave the trainer. The run publishes through
        :meth:`pack_weights` and :meth:`take_weights` instead; this is the direct read."""
        packed = self._pack(getattr(self, "_export_buffer", None))
        if packed is not None:
            self._export_buffer = packed.buffer
        return packed

    def pack_weights(self) -> dict | None:
        """Pack the current policy for :meth:`take_weights` (every rank must call it, right behind an update: under
        ZeRO-3 the parameters are gathered bucket by bucket); rank 0 returns ``{"version", "nbytes", "t_pack_s"}``,
        the others None. The copy into the object store runs in :meth:`take_weights`, while the next update runs."""
        import time

        t0 = time.perf_counter()
        if self.rank != 0:
            return self._pack(None)
        slot, buffer = self.exports.acquire(self.cfg.weight_sync.timeout_s)
        try:
            packed = self._pack(buffer)
        except BaseException as err:
            self.exports.fail(slot, err)
            raise
        self.exports.ready(slot, packed)
        return {"version": packed.version, "nbytes": packed.nbytes, "t_pack_s": time.perf_counter() - t0}

    @ray.method(concurrency_group="publish")
    def take_weights(self) -> list:
        """Rank 0, in the actor's publish thread (the next update runs meanwhile): the oldest export of
        :meth:`pack_weights` copied into Ray's object store; returns ``[its ref, the copy's seconds]`` (rank 0 owns
        the object). Raises the pack's error when it failed."""
        import time

        slot, packed = self.exports.take(self.cfg.weight_sync.timeout_s + 600)
        try:
            t0 = time.perf_counter()
            return [ray.put(packed), time.perf_counter() - t0]
        finally:
            self.exports.release(slot)

    def _pack(self, out):
        """The current policy packed on rank 0 into ``out`` if it fits (None on the other ranks)."""
        from mugrpo_async.training.guard import params_finite
        from mugrpo_async.weight_sync.exports import pack_params

        return pack_params(dict(self.engine.module.named_parameters()), self.updater.num_updates,
                           keep=self.rank == 0, bucket_bytes=int(self.cfg.weight_sync.bucket_mb * 2**20),
                           gathered=self._bucket_gathered, finite=params_finite, out=out)  # fmt: skip

    def _bucket_gathered(self, tensors: list):
        """A context in which ``tensors`` are whole: ZeRO-3's gather, entered by every rank; a no-op otherwise."""
        import deepspeed

        return deepspeed.zero.GatheredParameters(tensors, enabled=self.cfg.trainer.zero_stage == 3)

    def join_weight_group(self, host: str, port: int, world_size: int, transport: str) -> None:
        """Rank 0: serve the ``collective`` weight-sync group's store at ``host:port`` and join it as its rank 0
        (`mugrpo_async.weight_sync.group`); blocks until every engine worker has joined."""
        from mugrpo_async.weight_sync.group import join_group, leave_group

        leave_group(getattr(self, "weight_group", None))
        self.weight_group = join_group(host, port, 0, world_size, transport, self.cfg.weight_sync.timeout_s, host)

    def leave_weight_group(self) -> None:
        """Leave the ``collective`` group and the ``cuda_ipc`` store (whichever this rank is in)."""
        from mugrpo_async.weight_sync import ipc
        from mugrpo_async.weight_sync.group import leave_group

        leave_group(getattr(self, "weight_group", None))
        ipc.leave(getattr(self, "ipc", None))
        self.weight_group = self.ipc = None

    def join_ipc(self, host: str, port: int) -> str:
        """Open the ``cuda_ipc`` sync's store at ``host:port`` (rank 0 serves it) as the member of this rank's
        device (`mugrpo_async.weight_sync.ipc`); returns the device key."""
        import torch

        from mugrpo_async.weight_sync import ipc

        ipc.leave(getattr(self, "ipc", None))
        key = ipc.device_key(torch.device(self.device.device), ray.util.get_node_ip_address(), self.rank)
        self.ipc = ipc.join(host, port, key, self.cfg.weight_sync.timeout_s, serve=self.rank == 0)
        return key

    def send_weights_ipc(self, sync_id: int) -> None:
        """Stage the current policy bucket by bucket for the engine workers of this rank's device; every rank must
        call it. Weights that are not finite raise once the sync is over."""
        import torch

        from mugrpo_async.training.guard import params_finite
        from mugrpo_async.weight_sync.ipc import share_state

        params, w = dict(self.engine.module.named_parameters()), self.cfg.weight_sync
        ok = share_state(self.ipc, params, sync_id, self.updater.num_updates, int(w.bucket_mb * 2**20),
                         torch.device(self.device.device), self._bucket_gathered, params_finite)  # fmt: skip
        self._finite_or_raise(ok)

    def send_weights(self, sync_id: int) -> None:
        """Broadcast the current policy (version = update count) to the weight group in buckets; every rank must
        call it (under ZeRO-3 each bucket is gathered on every rank), rank 0 sends. Weights that are not finite
        raise once the sync is over."""
        from mugrpo_async.training.guard import params_finite
        from mugrpo_async.weight_sync.group import send_state

        params, w = dict(self.engine.module.named_parameters()), self.cfg.weight_sync
        group = getattr(self, "weight_group", None) if self.rank == 0 else None
        ok = send_state(group, params, sync_id, self.updater.num_updates, int(w.bucket_mb * 2**20),
                        self._bucket_gathered, params_finite)  # fmt: skip
        self._finite_or_raise(ok)

    def _finite_or_raise(self, ok: bool) -> None:
        if not ok:
            raise FloatingPointError(f"update {self.updater.num_updates}: the weights are not finite")

    def save_state(self, folder: str) -> None:
        """This rank's share of a checkpoint in ``folder`` (every rank must call it): rank 0 the policy as HF
        files, every rank ``trainer/rank-<r>`` (`mugrpo_async.checkpoints.trainer_state`)."""
        from mugrpo_async.checkpoints.model_folder import write_hf_files
        from mugrpo_async.checkpoints.trainer_state import save_rank_state
        from mugrpo_async.training.lr_schedule import scheduler_state

        state = self.full_state()
        if self.rank == 0:
            write_hf_files(self.engine.module, state, self.cfg.model.path, folder)
        u = self.updater
        save_rank_state(folder, self.rank, self.engine.optimizer.state_dict(), u.num_updates, self.world_size,
                        self.cfg.trainer.zero_stage, u.clock.state(),
                        scheduler_state(self.engine.lr_scheduler))  # fmt: skip

    def load_state(self, folder: str) -> int:
        """Restore weights, optimizer, RNG and update count from a checkpoint; returns the update count."""
        import torch

        from mugrpo_async.checkpoints.trainer_state import load_trainer_tree, read_weights, restore_optimizer
        from mugrpo_async.training.lr_schedule import restore_scheduler

        weights = read_weights(folder, dict(self.engine.module.named_parameters()))
        params, gathered = self._gathered(modifier_rank=0)
        with gathered, torch.no_grad():  # ZeRO-3: rank 0's copy is scattered on exit
            for name, p in params.items():
                p.data.copy_(weights[name].to(p.dtype))
        opt = self.engine.optimizer
        tree = load_trainer_tree(folder, self.rank, opt.state_dict(), self.world_size, self.cfg.trainer.zero_stage)
        restore_optimizer(opt, tree["optimizer"], self.rank, self.world_size)
        restore_scheduler(self.engine.lr_scheduler, tree["lr_scheduler"])  # after the optimizer: its lr wins
        torch.set_rng_state(tree["torch_rng"])
        self.updater.num_updates = int(tree["num_updates"])
        self.updater.clock.load(tree)  # the idle ratio continues
        return self.updater.num_updates

    def save_hf(self, path: str) -> str | None:
        """Write the policy as an HF folder (safetensors) at ``path`` atomically (rank 0 writes)."""
        from mugrpo_async.checkpoints.model_folder import save_hf_folder

        state = self.full_state()
        return None if self.rank != 0 else str(save_hf_folder(self.engine.module, state, self.cfg.model.path, path))
