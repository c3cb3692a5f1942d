"""Loading the policy model as configured (dtype, remote code) with transformers."""

from __future__ import annotations

from mugrpo_async.config import ModelConfig


def load_causal_lm(model: ModelConfig):
    """``AutoModelForCausalLM`` from ``model.path`` in ``model.dtype``; model code runs only if the config allows."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model.path, dtype=getattr(torch, model.dtype),
                                                trust_remote_code=model.trust_remote_code)  # fmt: skip
