"""The tiny default model: a byte-level tokenizer and a small Qwen2, warm-started in code.

No model hub is reachable on CPU machines, so the default policy is built here: a tokenizer trained
with ``tokenizers`` on the arithmetic task's texts (:mod:`mugrpo_async.data.task`), a randomly initialised
``Qwen2ForCausalLM`` (tied embeddings, head size 32, which vLLM's CPU attention supports), and a short
supervised warm start so that sampling at temperature 1.0 solves a fair share of problems but not all:
RL then has signal to learn from. The result is a normal HF folder (safetensors, tokenizer,
generation config) that transformers and vLLM both load.

Build or reuse the cached folder (idempotent; seconds when cached)::

    python -m launch.prepare --out .cache/models/tiny-arith
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from mugrpo_async.checkpoints.model_folder import build_once
from mugrpo_async.data.task import LEVELS, TASK_VERSION, Problem, generate_problems, prompt_text, target_text
from mugrpo_async.models.warm_start import teacher_forced
from mugrpo_async.rewards.boxed_math import boxed_reward

logger = logging.getLogger(__name__)

TINY_VERSION = "tiny-v4"
"""Bump when this module's build changes; part of the cache hash with :data:`TASK_VERSION`."""

PAD_TOKEN, EOS_TOKEN = "<|pad|>", "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN)
"""Special tokens, ids 0 and 1."""

QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
r"""Qwen2's pre-tokenizer split pattern; ``\p{N}`` alone makes every digit its own piece."""

MARKER_FILE = "tiny_build.json"
"""File in a built folder holding the build hash, the spec, the build time and the final loss."""

_IGNORE = -100  # label of positions without loss (prompt, padding)


@dataclasses.dataclass(frozen=True)
class TinySpec:
    """Everything that determines a tiny model folder; its hash keys the cache.

    Attributes:
        seed: Seed of the model init, the training problems and the data order.
        steps: Optimizer steps of the warm start.
        batch_size: Problems per step.
        lr: Peak AdamW learning rate (linear warm-up, then cosine decay to 10%).
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warm-up steps.
        hidden_size: Model width; a multiple of ``head_dim``.
        num_layers: Decoder layers.
        head_dim: Attention head size (vLLM's CPU attention supports 32, 64, 80, ...).
        num_kv_heads: Key/value heads (grouped-query attention); divides the number of heads.
        intermediate_size: MLP width.
        max_position_embeddings: Longest sequence (prompt + response) the model accepts.
        levels: Task levels of the training problems, cycled through (see
            :func:`~mugrpo_async.data.task.generate_problems`); a level listed twice gets twice the data.
            The default doubles the two hard levels, which made their accuracy less seed-dependent.
        boxed_fraction: Share of warm-start targets written as ``\\boxed{answer}``; the rest give the
            bare answer, which scores 0. RL then has a format to learn as well as arithmetic to sharpen.
    """

    seed: int = 0
    steps: int = 1300
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    hidden_size: int = 64
    num_layers: int = 2
    head_dim: int = 32
    num_kv_heads: int = 1
    intermediate_size: int = 256
    max_position_embeddings: int = 256
    levels: tuple[int, ...] = (1, 2, 3, 4, 3, 4)
    boxed_fraction: float = 0.5

    def model_kwargs(self) -> dict[str, int]:
        """Returns the fields that size the model, as keyword arguments of :func:`build_model`."""
        names = ("hidden_size", "num_layers", "head_dim", "num_kv_heads", "intermediate_size")
        return {name: getattr(self, name) for name in (*names, "max_position_embeddings")}

    def digest(self) -> str:
        """Returns a hex hash of the spec and of the task/tiny source versions."""
        payload = {"spec": dataclasses.asdict(self), "task": TASK_VERSION, "tiny": TINY_VERSION}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def build_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """Trains a byte-level tokenizer on ``texts``, built exactly like Qwen2's.

    The pipeline is Qwen2's (NFC, Qwen2's split regex, which isolates every digit, then byte-level
    mapping; byte-level decoder) because transformers 5 rebuilds that pipeline for any folder whose
    config says ``model_type: qwen2`` (``AutoTokenizer`` returns ``Qwen2Tokenizer``, also inside vLLM),
    keeping only the vocabulary and merges: a different pipeline would be silently replaced. The BPE
    trainer's vocabulary is capped at the 256 byte symbols, so no merges are learnt: every byte is
    one token, digits are single tokens, and tokenizing a prompt and its response separately gives
    the ids of their concatenation. Special tokens: pad 0, eos 1; nothing is added around encoded
    text (no bos).

    Args:
        texts: Training texts (prompts and responses of the task).

    Returns:
        The tokenizer, built from in-memory objects (not files: transformers 5 silently builds an
        empty tokenizer from some file arguments).
    """
    tok = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIAL_TOKENS) + len(alphabet),  # room for the byte alphabet only: no merges
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN)


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = TinySpec.hidden_size,
    num_layers: int = TinySpec.num_layers,
    head_dim: int = TinySpec.head_dim,
    num_kv_heads: int = TinySpec.num_kv_heads,
    intermediate_size: int = TinySpec.intermediate_size,
    max_position_embeddings: int = TinySpec.max_position_embeddings,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """Builds a randomly initialised float32 Qwen2 sized for ``tokenizer``.

    Embeddings are tied (``lm_head`` shares ``embed_tokens``), as in small Qwen2 models. The init is
    seeded without touching the caller's global RNG state.

    Args:
        tokenizer: Gives the vocabulary size and the pad/eos ids.
        hidden_size: Model width, a multiple of ``head_dim``.
        num_layers: Decoder layers.
        head_dim: Attention head size.
        num_kv_heads: Key/value heads; must divide ``hidden_size // head_dim``.
        intermediate_size: MLP width.
        max_position_embeddings: Longest sequence.
        seed: Seed of the init.

    Returns:
        The model, in train mode.
    """
    num_heads = hidden_size // head_dim
    if num_heads * head_dim != hidden_size or num_heads % num_kv_heads:
        raise ValueError(f"bad head layout: hidden {hidden_size}, head_dim {head_dim}, kv {num_kv_heads}")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.train()
    return model


def supervised_target(problem: Problem, boxed_fraction: float = 1.0) -> str:
    """The warm-start response: ``target_text`` for a ``boxed_fraction`` share of problems (chosen
    by a hash of the id, so deterministic), else the bare answer (``" 68"``)."""
    boxed = zlib.crc32(problem.id.encode()) % 10_000 < boxed_fraction * 10_000
    return target_text(problem) if boxed else f" {problem.answer}"


def encode_supervised(
    tokenizer: PreTrainedTokenizerFast, problems: Sequence[Problem], boxed_fraction: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encodes ``prompt + target + eos`` per problem, right-padded, loss on target and eos only.

    Args:
        tokenizer: The tiny tokenizer.
        problems: B problems.
        boxed_fraction: see :func:`supervised_target`.

    Returns:
        ``(input_ids, attention_mask, labels)``, each (B, T) int64; ``labels`` is -100 on prompt and
        padding positions and equals ``input_ids`` elsewhere.
    """
    prompts = tokenizer([prompt_text(p) for p in problems], add_special_tokens=False)["input_ids"]
    texts = [supervised_target(p, boxed_fraction) for p in problems]
    targets = tokenizer(texts, add_special_tokens=False)["input_ids"]
    T = max(len(p) + len(t) + 1 for p, t in zip(prompts, targets))
    input_ids = torch.full((len(problems), T), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(problems), T), _IGNORE, dtype=torch.long)
    attention_mask = torch.zeros((len(problems), T), dtype=torch.long)
    for row, (prompt, target) in enumerate(zip(prompts, targets)):
        ids = prompt + target + [tokenizer.eos_token_id]
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, len(prompt) : len(ids)] = torch.tensor(ids[len(prompt) :])
        attention_mask[row, : len(ids)] = 1
    return input_ids, attention_mask, labels


def train_supervised(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, spec: TinySpec) -> float:
    """Teacher-forced AdamW training on freshly generated problems, loss on response tokens only.

    Step ``k`` draws ``generate_problems(spec.batch_size, seed=spec.seed * 1_000_003 + k)``, so the data
    depends only on the spec.

    Args:
        model: The model to train in place.
        tokenizer: Its tokenizer.
        spec: Steps, batch size and optimizer settings.

    Returns:
        The mean loss of the last 50 steps.
    """

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        problems = generate_problems(spec.batch_size, seed=spec.seed * 1_000_003 + step, levels=spec.levels)
        input_ids, _, labels = encode_supervised(tokenizer, problems, spec.boxed_fraction)  # (B, T) each
        return input_ids, labels

    return teacher_forced(model, spec, batch, log_every=200)


@torch.no_grad()
def sampled_accuracy(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: Sequence[Problem],
    *,
    seed: int,
    max_new_tokens: int = 16,
    batch_size: int = 256,
) -> dict[int, float]:
    """Samples one response per problem at temperature 1.0 (no top-k/top-p) and scores it.

    Args:
        model: The policy (evaluated in eval mode).
        tokenizer: Its tokenizer.
        problems: Problems to solve.
        seed: Seed of the sampling (the caller's RNG state is kept).
        max_new_tokens: Response length cap.
        batch_size: Problems per ``generate`` call.

    Returns:
        Accuracy (mean :func:`~mugrpo_async.rewards.boxed_math.boxed_reward`) per level present in ``problems``.
    """
    model.eval()
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generate from the right end
    scores: dict[int, list[float]] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            batch = tokenizer([prompt_text(p) for p in chunk], return_tensors="pt", padding=True)
            out = model.generate(
                **batch,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
            texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            for problem, text in zip(chunk, texts):
                scores.setdefault(problem.level, []).append(boxed_reward(text, problem.answer))
    tokenizer.padding_side = padding_side
    return {level: sum(s) / len(s) for level, s in sorted(scores.items())}


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Sets torch's intra-op threads for the block and restores the previous value.

    One thread is the sensible default for this model: its matrices are so small that a second
    thread gains little on an idle 2-core machine, while on a busy one (Ray workers, a vLLM engine,
    tests in parallel) OpenMP threads that wait for each other at every operation made a training
    step about 50x slower (2 s instead of 35 ms), and one thread keeps results independent of the
    machine's core count.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _save_folder(
    folder: Path, model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, marker: dict[str, Any]
) -> None:
    """Writes the HF folder: safetensors weights, config, tokenizer, generation config, marker."""
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(folder)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=24,
    ).save_pretrained(folder)
    (folder / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def _replace_atomically(tmp: Path, out_dir: Path) -> None:
    """Moves the finished folder ``tmp`` to ``out_dir``; an old one is renamed away first, then deleted."""
    old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def warm_start(out_dir: str | Path, *, seed: int = 0, num_threads: int = 1, **spec_fields: Any) -> Path:
    """Builds the tiny model from scratch, warm-starts it and writes it to ``out_dir`` atomically.

    The folder is written next to ``out_dir`` under a temporary name and renamed into place when
    complete, so readers never see a half-written model. It replaces any existing ``out_dir``
    (which is absent for the instant between the two renames).

    Args:
        out_dir: Destination folder.
        seed: Seed of everything (init, data, order): the same spec gives the same weights on the
            same machine and thread count.
        num_threads: Torch intra-op threads while building (see :func:`torch_threads`); not part
            of the spec, but results may differ in the last bits with another value.
        **spec_fields: Other :class:`TinySpec` fields (``steps``, ``lr``, ``hidden_size``, ...).

    Returns:
        ``out_dir`` as a Path.
    """
    spec = TinySpec(seed=seed, **spec_fields)
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with torch_threads(num_threads):
        problems = generate_problems(400, seed=spec.seed, levels=LEVELS)
        tokenizer = build_tokenizer([prompt_text(p) for p in problems] + [target_text(p) for p in problems])
        model = build_model(tokenizer, seed=spec.seed, **spec.model_kwargs())
        final_loss = train_supervised(model, tokenizer, spec)
    build_s = time.perf_counter() - started
    marker = {
        "hash": spec.digest(),
        "spec": dataclasses.asdict(spec),
        "task_version": TASK_VERSION,
        "tiny_version": TINY_VERSION,
        "build_s": round(build_s, 2),
        "final_loss": round(final_loss, 5),
    }
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        _save_folder(tmp, model, tokenizer, marker)
        _replace_atomically(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny model in %s (%.1f s, final loss %.4f)", out_dir, build_s, final_loss)
    return out_dir


def read_marker(out_dir: str | Path) -> dict[str, Any] | None:
    """Returns the build marker of a tiny model folder, or None if there is none or it is unreadable."""
    from mugrpo_async.checkpoints.model_folder import read_build_marker

    return read_build_marker(out_dir, MARKER_FILE)


def _is_built(out_dir: Path, spec: TinySpec) -> bool:
    """Whether ``out_dir`` holds a finished build of ``spec``."""
    marker = read_marker(out_dir)
    return marker is not None and marker.get("hash") == spec.digest()


def ensure_tiny_model(out_dir: str | Path, *, force: bool = False, num_threads: int = 1, **kw: Any) -> Path:
    """Returns ``out_dir`` holding the tiny model for these parameters, building it only if needed.

    Idempotent cache: when ``out_dir`` has a marker whose hash equals that of ``TinySpec(**kw)``
    (which covers the task and tiny source versions) it returns at once; otherwise it calls
    :func:`warm_start`. A lock file next to ``out_dir`` keeps concurrent callers from building twice.

    Args:
        out_dir: Cache folder, e.g. ``.cache/models/tiny-arith``.
        force: Build even if the cached folder is valid (it is then replaced atomically).
        num_threads: Torch threads for a build, as in :func:`warm_start`.
        **kw: :class:`TinySpec` fields; unknown names raise TypeError.

    Returns:
        ``out_dir`` as a resolved Path.
    """
    spec = TinySpec(**kw)
    out_dir = Path(out_dir).resolve()

    def build() -> Path:
        logger.info("building tiny model into %s", out_dir)
        return warm_start(out_dir, num_threads=num_threads, **dataclasses.asdict(spec))

    return build_once(out_dir, lambda d: _is_built(d, spec), build, force)
