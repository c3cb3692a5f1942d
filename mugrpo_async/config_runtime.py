"""The config tree's sections on where and how a run runs: placement, weight sync, logging, checkpoints (the
others: :mod:`mugrpo_async.config_sections`). Import them from :mod:`mugrpo_async.config`. Imports without torch or
Ray.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mugrpo_async.config_sections import PlacementMode, _Section


class PlacementConfig(_Section):
    mode: PlacementMode = Field(
        "split",
        description="split: rollout engines and trainer ranks on separate devices (every actor's bundles reserved "
        "in one Ray placement group before any starts); colocated: engine i and trainer rank i share device i "
        "(sync mode: they take turns, the engine asleep while the rank trains; mugrpo_async.colocation).",
    )
    timeout_s: float = Field(
        300.0, gt=0.0, description="Longest wait for the cluster to grant the reservation (exit 2 after it)."
    )


class LoggingConfig(_Section):
    tensorboard: bool = Field(True, description="Write TensorBoard events beside metrics.jsonl.")
    progress: bool = Field(True, description="Show progress bars.")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    status_every_s: float = Field(
        30.0,
        ge=0,
        le=86400,
        description="Every this many seconds the driver logs one status line (updates, idle ratio, lag, queue, "
        "groups) and writes <output_dir>/status.json for `python -m launch.watch`; 0: neither.",
    )
    wandb: bool = Field(False, description="Also log the records to Weights & Biases (the optional `wandb` extra).")
    wandb_project: str = Field("mugrpo-async", min_length=1, description="Weights & Biases project.")
    wandb_run_name: str | None = Field(None, min_length=1, description="Weights & Biases run name (unset: run.name).")
    wandb_mode: Literal["auto", "online", "offline"] = Field(
        "auto",
        description="auto: online when WANDB_API_KEY is set, else offline (files under <output_dir>/wandb, no "
        "network); an explicit WANDB_MODE in the environment wins.",
    )


class CheckpointConfig(_Section):
    every_updates: int = Field(
        0,
        ge=0,
        description="Save every this many updates and after the last one (0: every min(mu, total_updates // 4) "
        "updates); the same rule in both modes (mugrpo_async/training/schedule.py).",
    )
    keep: int = Field(2, ge=1, description="Newest checkpoints kept.")


class WeightSyncConfig(_Section):
    backend: Literal["auto", "object_store", "collective", "cuda_ipc"] = Field(
        "auto",
        description="How the trainer's weights reach the rollout engines (mugrpo_async.weight_sync): object_store "
        "(one packed buffer through Ray's object store), collective (trainer rank 0 broadcasts in buckets over a "
        "process group of its own with every engine's worker: gloo on CPU, NCCL on GPU; sync mode only), "
        "cuda_ipc (placement.mode colocated, sync mode: each trainer rank stages the buckets on its device and the "
        "engine worker of that device reads them through CUDA IPC handles; on CPU the same protocol over shared "
        "memory); auto: object_store in async mode and on GPUs (neither collective's NCCL path nor cuda_ipc's "
        "handles have run on one), on CPU the fastest measured in benchmark 3 that applies.",
    )
    bucket_mb: float = Field(
        128.0,
        gt=0.0,
        le=8192.0,
        description="collective, cuda_ipc, object_store's pack: MiB per bucket (whole blocks, a larger one alone).",
    )
    timeout_s: float = Field(
        120.0,
        gt=0.0,
        description="collective, cuda_ipc: longest wait of one call (forming the group, a bucket, an ack).",
    )
