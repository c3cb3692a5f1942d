"""The tiny model of the multi-step task (:mod:`mugrpo_async.data.steps_task`), warm-started in code.

The same tokenizer, architecture and folder layout as the default tiny model (:mod:`mugrpo_async.models.tiny`:
its :func:`~mugrpo_async.models.tiny.build_tokenizer`, :func:`~mugrpo_async.models.tiny.build_model` and folder
writer are reused), warm-started on worked responses of the multi-step task. The warm start mixes correct
and corrupted traces: each step of a training response is wrong with probability ``error_rate`` and the
following steps continue from the wrong value (:func:`~mugrpo_async.data.steps_task.corrupted_results`), so the
model learns to make a mistake per step at least at that rate and to keep reasoning after one. The warm start
is also short (800 steps of 32 problems): most sampled errors are carries it has not learnt yet. Its sampled
accuracy at temperature 1.0 is neither 0 nor 1 at any level and falls with the number of steps (figures in
README.md, "The multi-step task").

Build or reuse the cached folder (224 s measured on a busy 2-core machine, one torch thread; seconds when
cached)::

    python -m launch.prepare --model tiny-steps --out .cache/models/tiny-steps
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from mugrpo_async.checkpoints.model_folder import build_once, read_build_marker
from mugrpo_async.data.steps_task import (
    STEP_LEVELS,
    STEPS_TASK_VERSION,
    StepsProblem,
    corrupted_results,
    generate_steps_problems,
    prompt_text,
    target_text,
    worked_steps,
)
from mugrpo_async.models.tiny import (
    MARKER_FILE,
    _replace_atomically,
    _save_folder,
    build_model,
    build_tokenizer,
    torch_threads,
)
from mugrpo_async.models.warm_start import teacher_forced
from mugrpo_async.rewards.boxed_math import boxed_reward

logger = logging.getLogger(__name__)

TINY_STEPS_VERSION = "tiny-steps-v1"
"""Bump when this module's build changes; part of the cache hash with :data:`STEPS_TASK_VERSION`."""

_IGNORE = -100  # label of positions without loss (prompt, padding)


@dataclasses.dataclass(frozen=True)
class StepsSpec:
    """Everything that determines a tiny multi-step model folder; its hash keys the cache.

    Attributes:
        seed: Seed of the model init, the training problems, their corruptions and the data order.
        steps: Optimizer steps of the warm start.
        batch_size: Problems per step.
        lr: Peak AdamW learning rate (linear warm-up, then cosine decay to 10%).
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warm-up steps.
        hidden_size: Model width; a multiple of ``head_dim``.
        num_layers: Decoder layers.
        head_dim: Attention head size (vLLM's CPU attention supports 32, 64, 80, ...).
        num_kv_heads: Key/value heads; divides the number of heads.
        intermediate_size: MLP width.
        max_position_embeddings: Longest sequence (prompt + response) the model accepts.
        levels: Levels of the training problems, cycled through.
        error_rate: Probability that a step of a training response is wrong (then carried through).
    """

    seed: int = 0
    steps: int = 800
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    hidden_size: int = 64
    num_layers: int = 2
    head_dim: int = 32
    num_kv_heads: int = 1
    intermediate_size: int = 256
    max_position_embeddings: int = 256
    levels: tuple[int, ...] = STEP_LEVELS
    error_rate: float = 0.05

    def model_kwargs(self) -> dict[str, int]:
        """The fields that size the model, as keyword arguments of :func:`~mugrpo_async.models.tiny.build_model`."""
        names = ("hidden_size", "num_layers", "head_dim", "num_kv_heads", "intermediate_size")
        return {name: getattr(self, name) for name in (*names, "max_position_embeddings")}

    def digest(self) -> str:
        """A hex hash of the spec and of the task/model source versions."""
        payload = {"spec": dataclasses.asdict(self), "task": STEPS_TASK_VERSION, "model": TINY_STEPS_VERSION}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


STEPS_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-steps": {},
    "tiny-steps-1m": {"hidden_size": 128, "num_layers": 4, "intermediate_size": 512, "num_kv_heads": 2},
}
"""The multi-step task's models by ``launch.prepare --model`` name, as :class:`StepsSpec` fields over its defaults:
``tiny-steps`` (139,968 parameters) and the study's second model ``tiny-steps-1m`` (1,018,240; docs/STUDY.md,
"Second model"), both with the tokenizer of this task (258 tokens) and tied embeddings. The warm-start length
(``steps``) is the default unless ``launch.prepare --warm-start-steps`` sets it."""


def training_batch(
    tokenizer: PreTrainedTokenizerFast, problems: Sequence[StepsProblem], error_rate: float, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompt + response + eos`` per problem, right-padded, the response's steps corrupted at ``error_rate``.

    Returns:
        ``(input_ids, labels)``, each (B, T) int64; ``labels`` is -100 on prompt and padding positions.
    """
    prompts = tokenizer([prompt_text(p) for p in problems], add_special_tokens=False)["input_ids"]
    texts = [worked_steps(p, corrupted_results(p, error_rate, rng)) for p in problems]
    responses = tokenizer(texts, add_special_tokens=False)["input_ids"]
    T = max(len(p) + len(r) + 1 for p, r in zip(prompts, responses))
    input_ids = torch.full((len(problems), T), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(problems), T), _IGNORE, dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        ids = prompt + response + [tokenizer.eos_token_id]
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, len(prompt) : len(ids)] = torch.tensor(ids[len(prompt) :])
    return input_ids, labels


def train_steps_model(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, spec: StepsSpec) -> float:
    """Teacher-forced AdamW on freshly drawn, partly corrupted traces; returns the mean loss of the last 50 steps.

    Step ``k`` draws ``spec.batch_size`` problems of level ``spec.levels[k % len(spec.levels)]`` with seed
    ``spec.seed * 1_000_003 + k`` and corrupts them with a generator of the same seed, so the data depends only
    on the spec.
    """

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        seed = spec.seed * 1_000_003 + step
        # One level per step (cycling): short responses are not padded to the longest level's length.
        level = spec.levels[step % len(spec.levels)]
        problems = generate_steps_problems(spec.batch_size, seed=seed, levels=(level,))
        return training_batch(tokenizer, problems, spec.error_rate, random.Random(-seed - 1))

    return teacher_forced(model, spec, batch, log_every=100)


@torch.no_grad()
def sampled_steps_accuracy(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: Sequence[StepsProblem],
    *,
    seed: int,
    max_new_tokens: int = 128,
    batch_size: int = 128,
) -> dict[int, float]:
    """One response per problem sampled with transformers at temperature 1.0, scored by
    :func:`~mugrpo_async.rewards.boxed_math.boxed_reward`: the accuracy per level (a quick check of a build;
    ``python -m launch.lengths`` measures lengths and accuracy with the vLLM engine the runs use)."""
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generate from the right end
    scores: dict[int, list[float]] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            batch = tokenizer([prompt_text(p) for p in chunk], return_tensors="pt", padding=True)
            out = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            for problem, text in zip(chunk, texts):
                scores.setdefault(problem.level, []).append(boxed_reward(text, problem.answer))
    tokenizer.padding_side = padding_side
    return {level: sum(s) / len(s) for level, s in sorted(scores.items())}


def warm_start_steps(out_dir: str | Path, *, num_threads: int = 1, **spec_fields: Any) -> Path:
    """Builds the multi-step model from scratch, warm-starts it and writes it to ``out_dir`` atomically.

    Args:
        out_dir: Destination folder (replaced if present; readers never see a half-written one).
        num_threads: Torch intra-op threads while building (not part of the spec).
        **spec_fields: :class:`StepsSpec` fields.

    Returns:
        ``out_dir`` as a Path.
    """
    spec = StepsSpec(**spec_fields)
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with torch_threads(num_threads):
        problems = generate_steps_problems(400, seed=spec.seed)
        tokenizer = build_tokenizer([prompt_text(p) for p in problems] + [target_text(p) for p in problems])
        model = build_model(tokenizer, seed=spec.seed, **spec.model_kwargs())
        final_loss = train_steps_model(model, tokenizer, spec)
    build_s = time.perf_counter() - started
    marker = {"hash": spec.digest(), "spec": dataclasses.asdict(spec), "task_version": STEPS_TASK_VERSION,
              "model_version": TINY_STEPS_VERSION, "build_s": round(build_s, 2),
              "final_loss": round(final_loss, 5)}  # fmt: skip
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        _save_folder(tmp, model, tokenizer, marker)
        _replace_atomically(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny multi-step model in %s (%.1f s, final loss %.4f)", out_dir, build_s, final_loss)
    return out_dir


def ensure_steps_model(out_dir: str | Path, *, force: bool = False, num_threads: int = 1, **kw: Any) -> Path:
    """Returns ``out_dir`` holding the multi-step model of ``StepsSpec(**kw)``, building it only if needed: a
    cache keyed by the spec's hash, one builder at a time (as :func:`~mugrpo_async.models.tiny.ensure_tiny_model`)."""
    spec = StepsSpec(**kw)
    out_dir = Path(out_dir).resolve()

    def is_built(folder: Path) -> bool:
        marker = read_build_marker(folder, MARKER_FILE)
        return marker is not None and marker.get("hash") == spec.digest()

    def build() -> Path:
        logger.info("building tiny multi-step model into %s", out_dir)
        return warm_start_steps(out_dir, num_threads=num_threads, **dataclasses.asdict(spec))

    return build_once(out_dir, is_built, build, force)
