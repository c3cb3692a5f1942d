"""Build (or reuse) the tiny default model and report its sampled accuracy per task level.

Run from the repository root::

    python -m launch.prepare --out .cache/models/tiny-arith [--force]

The folder is cached: a second run returns in seconds unless ``--force`` is given. Accuracy is
measured by sampling one response per held-out problem at temperature 1.0 with transformers.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

EVAL_SEED = 9_999_991
"""Seed of the held-out problems; training draws from other seeds (the small levels have so few
distinct problems that the same ones recur anyway)."""


def main(argv: list[str] | None = None) -> int:
    """Parses arguments, builds or reuses the model folder and prints folder, time and accuracy."""
    parser = argparse.ArgumentParser(prog="python -m launch.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/models/tiny-arith"), help="model folder")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cached folder is valid")
    parser.add_argument("--eval-per-level", type=int, default=200, help="held-out problems per level")
    parser.add_argument("--seed", type=int, default=0, help="build seed (TinySpec.seed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    # Heavy imports only after parsing, so --help is instant.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mugrpo_async.task import LEVELS, generate_problems
    from mugrpo_async.tiny import ensure_tiny_model, read_marker, sampled_accuracy, torch_threads

    started = time.perf_counter()
    folder = ensure_tiny_model(args.out, force=args.force, seed=args.seed)
    elapsed = time.perf_counter() - started
    marker = read_marker(folder) or {}

    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    problems = generate_problems(args.eval_per_level * len(LEVELS), seed=EVAL_SEED + args.seed)
    with torch_threads(1):
        accuracy = sampled_accuracy(model, tokenizer, problems, seed=EVAL_SEED)

    print(f"model folder: {folder}")
    print(f"ensure_tiny_model: {elapsed:.1f} s (build time recorded at build: {marker.get('build_s')} s)")
    for level, value in accuracy.items():
        print(f"level {level}: sampled accuracy {value:.3f} (n={args.eval_per_level}, temperature 1.0)")
    print(f"mean over levels: {sum(accuracy.values()) / len(accuracy):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
