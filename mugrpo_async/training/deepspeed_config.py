"""The DeepSpeed config of one trainer rank, derived from the typed config (no DeepSpeed import needed)."""

from __future__ import annotations

from mugrpo_async.config import Config


def deepspeed_config(cfg: Config) -> dict:
    """DeepSpeed's JSON config: micro-batch size and accumulation steps per update, clipping, ZeRO stage, dtype.

    bf16's ``check_grad_overflow`` stays on: ZeRO then skips a step whose gradient norm is not finite itself
    (the trainer's non-finite guard reads that as a skipped update).
    """
    t = cfg.trainer
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": cfg.micro_batches_per_rank,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": cfg.model.dtype == "bfloat16", "check_grad_overflow": True},
        "fp16": {"enabled": cfg.model.dtype == "float16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
