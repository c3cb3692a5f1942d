"""Loading the policy model as configured (dtype, remote code) with transformers."""

from __future__ import annotations

from mugrpo_async.config import ModelConfig


def load_causal_lm(model: ModelConfig):
    """``AutoModelForCausalLM`` from ``model.path`` in ``model.dtype`` with ``model.attn_implementation`` (unset:
    transformers' default); model code runs only if the config allows."""
    import torch
    from transformers import AutoModelForCausalLM

    extra = {"attn_implementation": model.attn_implementation} if model.attn_implementation else {}
    return AutoModelForCausalLM.from_pretrained(model.path, dtype=getattr(torch, model.dtype),
                                                trust_remote_code=model.trust_remote_code, **extra)  # fmt: skip
