"""Memory estimates from the config alone (no Ray, no torch): model states per trainer rank, the vLLM KV cache,
host memory of a sync stage and the trainer's logits peak. The model is described in `mugrpo_async.reporting.plan`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mugrpo_async.choices import MODEL_DTYPES
from mugrpo_async.config import Config

GiB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each ``model.dtype``."""
assert tuple(DTYPE_BYTES) == MODEL_DTYPES, "DTYPE_BYTES must cover mugrpo_async.choices.MODEL_DTYPES exactly"


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A decoder-only transformer's sizes (Llama / Qwen2 / Qwen3 family: RMSNorm, gated MLP, GQA).

    Attributes:
        hidden_size: Model width H.
        num_layers: Decoder layers L.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (grouped-query attention).
        head_dim: Size of one attention head.
        intermediate_size: MLP width I (gate, up and down projections).
        vocab_size: Vocabulary size V.
        tied_embeddings: ``lm_head`` shares the input embedding.
        qkv_bias: The q, k and v projections have biases (Qwen2).
        qk_norm: Per-head RMSNorm on q and k (Qwen3).
        max_position_embeddings: Longest sequence the model was built for (None: unknown).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int | None = None

    def num_parameters(self) -> int:
        """Parameter count Psi (a tied ``lm_head`` counted once)."""
        H, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = H * q + 2 * H * kv + q * H  # q, k, v, o projections
        attention += (q + 2 * kv) if self.qkv_bias else 0
        attention += 2 * self.head_dim if self.qk_norm else 0
        mlp = 3 * H * self.intermediate_size
        layer = attention + mlp + 2 * H  # two RMSNorms
        embeddings = self.vocab_size * H * (1 if self.tied_embeddings else 2)
        return self.num_layers * layer + embeddings + H  # final RMSNorm

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token occupies: K and V for every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


KNOWN_ARCHITECTURES: dict[str, Architecture] = {
    # Published config.json numbers of the paper's models.
    "Qwen2.5-Math-7B": Architecture(3584, 28, 28, 4, 128, 18944, 152064, False, qkv_bias=True,
                                    max_position_embeddings=4096),
    "DeepSeek-R1-Distill-Qwen-7B": Architecture(3584, 28, 28, 4, 128, 18944, 152064, False, qkv_bias=True,
                                                max_position_embeddings=131072),
    "Qwen3-1.7B-Base": Architecture(2048, 28, 16, 8, 128, 6144, 151936, True, qk_norm=True,
                                    max_position_embeddings=32768),
    "Qwen3-8B-Base": Architecture(4096, 36, 32, 8, 128, 12288, 151936, False, qk_norm=True,
                                  max_position_embeddings=32768),
    "Llama-3.2-3B-Instruct": Architecture(3072, 28, 24, 8, 128, 8192, 128256, True,
                                          max_position_embeddings=131072),
    "Qwen2.5-Coder-7B": Architecture(3584, 28, 28, 4, 128, 18944, 152064, False, qkv_bias=True,
                                     max_position_embeddings=32768),
}  # fmt: skip
"""Fallback sizes keyed by model folder basename (matched case-insensitively)."""

_QKV_BIAS_TYPES = {"qwen2"}
_QK_NORM_TYPES = {"qwen3"}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def architecture_from_config(config: dict) -> tuple[Architecture | None, str]:
    """Reads an HF ``config.json`` mapping; returns ``(architecture, "")`` or ``(None, why not)``."""
    if any(k in config for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None, "mixture-of-experts models are not modelled"
    missing = [k for k in _REQUIRED if not isinstance(config.get(k), int)]
    if missing:
        return None, f"config.json lacks {', '.join(missing)}"
    heads = config["num_attention_heads"]
    model_type = config.get("model_type", "")
    arch = Architecture(
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type in _QKV_BIAS_TYPES or bool(config.get("attention_bias", False)),
        qk_norm=model_type in _QK_NORM_TYPES,
        max_position_embeddings=config.get("max_position_embeddings"),
    )
    return arch, ""


def resolve_architecture(model_path: str | Path) -> tuple[Architecture | None, str, str]:
    """Finds the model's sizes without loading it.

    Returns:
        ``(architecture or None, source, folder_note)``: ``source`` says where the sizes came from (or
        why there are none); ``folder_note`` is non-empty when the folder is missing or incomplete.
    """
    folder = Path(model_path)
    config_file = folder / "config.json"
    note, why = "", ""
    if not folder.is_dir():
        note = f"model folder {folder} does not exist here"
    elif not config_file.is_file():
        note = f"model folder {folder} has no config.json"
    else:
        try:
            arch, why = architecture_from_config(json.loads(config_file.read_text()))
        except (OSError, ValueError) as err:
            arch, why = None, f"config.json unreadable ({err})"
        if arch is not None:
            return arch, f"sizes from {config_file}", ""
        note = f"{config_file}: {why}"
    known = {name.lower(): name for name in KNOWN_ARCHITECTURES}
    name = known.get(folder.name.lower())
    if name is not None:
        return KNOWN_ARCHITECTURES[name], f"sizes from the built-in table: published architecture of {name}", note
    reason = why or f"{folder.name!r} is not in the built-in table ({', '.join(KNOWN_ARCHITECTURES)})"
    return None, f"unknown model: {reason}", note


def trainer_memory(num_params: int, dtype: str, zero_stage: int, num_ranks: int) -> dict[str, int]:
    """Per-rank bytes of model states under ZeRO (see the module docstring for the rules).

    Returns:
        ``{"weights", "gradients", "optimizer"}`` in bytes.
    """
    w = DTYPE_BYTES[dtype]
    k = 8 + (4 if w < 4 else 0)  # AdamW m, v in fp32 (+ fp32 master weights under mixed precision)

    def share(total: int, partitioned: bool) -> int:
        return -(-total // num_ranks) if partitioned else total

    return {
        "weights": share(w * num_params, zero_stage >= 3),
        "gradients": share(w * num_params, zero_stage >= 2),
        "optimizer": share(k * num_params, zero_stage >= 1),
    }


TYPED_BYTES_PER_TOKEN = 8
"""Host bytes per response token of a `Group`: an int32 token id and a float32 log-prob (typed arrays)."""
INDEX_BYTES_PER_GROUP = 700
"""Host bytes per group of a stage's index (a `GroupRef`: shard, byte span, sha256, prompt id, G rewards, counts;
measured with tracemalloc by ``bench.stage_memory``), and about as many again for its pickled copy."""
BATCH_BYTES_PER_POSITION = 29
"""A collated `Batch` per padded position: input_ids 8, attention_mask 8, response_index 8, mask 1, log-prob 4."""
LOGIT_COPIES_UNCHUNKED, LOGIT_COPIES_CHUNKED = 4, 3
"""float32 (positions, V) tensors alive at the peak of forward + backward (measured by bench.logprob_memory)."""


def host_memory(cfg: Config) -> dict[str, int]:
    """Host bytes per process for one sync stage, an upper bound (every response at ``rollout.max_new_tokens``).

    The driver and the trainer ranks hold the stage's index, not its groups (`mugrpo_async.rollout.shards`).
    With tokens(g) = g * (G * max_new_tokens + max_prompt_tokens), b = `TYPED_BYTES_PER_TOKEN` and
    i = `INDEX_BYTES_PER_GROUP`:

    - driver:       2 * i * B_train (the index, and its pickled copy in the object store for the ranks)
      + 3 * b * tokens(chunk) (one generation call's groups as they arrive, their msgpack shard, its parts);
    - trainer rank: i * B_train (the index) + b * tokens(B_mini) (the minibatch's groups, read from the shards)
      + 29 * B_mini * G * context (the minibatch collated); with ``algo.tis_cap``, + 4 * B_train * G *
      max_new_tokens (the trainer's float32 behaviour log-probs of the whole stage);
    - engine actor: b * tokens(chunk) (the groups of one generation call, ``rollout.chunk_groups`` /
      ``chunk_tokens``; vLLM's own host memory not included).
    """
    from mugrpo_async.rollout.chunks import chunk_plan

    s, r = cfg.schedule, cfg.rollout
    per_group = r.group_size * r.max_new_tokens + cfg.data.max_prompt_tokens
    context = cfg.data.max_prompt_tokens + r.max_new_tokens
    chunk = chunk_plan(s.groups_per_stage, r.num_workers, r.group_size, r.max_new_tokens, r.chunk_groups,
                       r.chunk_tokens).chunk_size * per_group  # fmt: skip
    index, b = INDEX_BYTES_PER_GROUP * s.groups_per_stage, TYPED_BYTES_PER_TOKEN
    tis = 4 * s.groups_per_stage * r.group_size * r.max_new_tokens if cfg.algo.tis_cap is not None else 0
    return {
        "driver": 2 * index + 3 * b * chunk,
        "trainer_rank": index
        + b * s.groups_per_update * per_group
        + BATCH_BYTES_PER_POSITION * s.groups_per_update * r.group_size * context
        + tis,
        "engine_actor": b * chunk,
    }


def logits_peak(cfg: Config, arch: Architecture) -> int:
    """Peak bytes of one micro-batch's logits on a trainer rank, forward + backward.

    P padded positions of a micro-batch: ``trainer.max_tokens_per_micro_batch`` (at least one whole context), or
    ``micro_batch_size`` x context; R <= P of them are response positions (``micro_batch_size`` x
    ``max_new_tokens`` without a budget). Unchunked: P * V * w (the model's logits) + 4 * R * V * 4 (float32
    copies: gathered, log-sum-exp, gradients). Chunked by c = ``trainer.logprob_chunk_tokens``: 3 * c * V * 4
    (one chunk's float32 logits, its softmax and its gradient) + R * H * w (the hidden states kept for backward).
    """
    t, r = cfg.trainer, cfg.rollout
    context = cfg.data.max_prompt_tokens + r.max_new_tokens
    w, v = DTYPE_BYTES[cfg.model.dtype], arch.vocab_size
    if t.max_tokens_per_micro_batch:
        positions = max(t.max_tokens_per_micro_batch, context)
        responses = positions * r.max_new_tokens // context
    else:
        positions, responses = t.micro_batch_size * context, t.micro_batch_size * r.max_new_tokens
    if t.logprob_chunk_tokens:
        return LOGIT_COPIES_CHUNKED * min(t.logprob_chunk_tokens, responses) * v * 4 + responses * arch.hidden_size * w
    return positions * v * w + LOGIT_COPIES_UNCHUNKED * responses * v * 4
