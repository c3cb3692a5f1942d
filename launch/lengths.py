"""Response lengths and accuracy per level of a config's synthetic task, sampled by the vLLM engine the runs use.

    python -m launch.lengths --config configs/tiny-cpu-reasoning.yaml [--problems 800] [--n 4] [key=value ...]

Samples ``--n`` responses per held-out problem (the task's evaluation draw, ``eval.num_problems`` = ``--problems``)
at ``rollout.temperature`` with ``rollout.max_new_tokens``, through one in-process vLLM engine built with a
rollout worker's engine arguments, and scores each with the training reward (the last ``\\boxed{}`` answer,
:func:`mugrpo_async.rewards.boxed_math.boxed_reward`). Prints response-length percentiles in tokens (p10, p50,
p90, p99, max), the share of responses cut at the limit and the accuracy, over all responses and per level.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

PERCENTILES = (10, 50, 90, 99)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.lengths", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config (model.path, data.source, rollout.*)")
    parser.add_argument("--problems", type=int, default=800, help="held-out problems (cycling through the levels)")
    parser.add_argument("--n", type=int, default=4, help="responses per problem")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    args = parser.parse_args(argv)

    from mugrpo_async.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, [*args.overrides, f"eval.num_problems={args.problems}"])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    responses = _sample(cfg, args.n)
    print(f"model {cfg.model.path}, data.source {cfg.data.source}, {args.problems} problems x {args.n} responses, "
          f"temperature {cfg.rollout.temperature:g}, max_new_tokens {cfg.rollout.max_new_tokens}")  # fmt: skip
    print(format_table(responses, cfg.rollout.max_new_tokens))
    return 0


def _sample(cfg, n: int) -> list[tuple[int, int, float]]:
    """``(level, response tokens, reward)`` per sampled response."""
    from mugrpo_async.rollout.engine import engine_args, engine_env

    for key, value in engine_env(cfg).items():  # before vLLM is imported
        os.environ.setdefault(key, value)
    from transformers import AutoTokenizer
    from vllm import LLM

    from mugrpo_async.data.pool import load_prompts
    from mugrpo_async.rewards.boxed_math import boxed_reward
    from mugrpo_async.rollout.groups import sampling_params

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    prompts, _ = load_prompts(cfg, tokenizer, split="heldout")
    llm = LLM(**engine_args(cfg, 0))
    params = sampling_params(n, cfg.rollout.temperature, cfg.rollout.max_new_tokens, logprobs=False)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p["prompt_ids"]} for p in prompts], params, use_tqdm=False)
    print(f"sampled in {time.perf_counter() - started:.1f} s")
    rows = []
    for prompt, out in zip(prompts, outputs):
        for completion in out.outputs:
            reward = boxed_reward(completion.text, prompt["answer"])
            rows.append((prompt["meta"].get("level", 0), len(completion.token_ids), reward))
    return rows


def percentile(values: list[int], q: float) -> float:
    """The ``q``-th percentile of ``values`` (linear interpolation between order statistics, as numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def format_table(rows: list[tuple[int, int, float]], limit: int) -> str:
    """One line per level and one for all responses: count, length percentiles, max, share cut at ``limit``,
    accuracy."""
    head = f"{'level':<6}{'n':>6}" + "".join(f"{'p' + str(q):>7}" for q in PERCENTILES)
    lines = [head + f"{'max':>7}{'at cap':>8}{'accuracy':>10}"]
    for level in [*sorted({r[0] for r in rows}), None]:
        chosen = [r for r in rows if level is None or r[0] == level]
        lengths = [r[1] for r in chosen]
        cells = "".join(f"{percentile(lengths, q):>7.0f}" for q in PERCENTILES)
        capped = sum(length >= limit for length in lengths) / len(lengths)
        accuracy = sum(r[2] for r in chosen) / len(chosen)
        name = "all" if level is None else str(level)
        lines.append(f"{name:<6}{len(chosen):>6}{cells}{max(lengths):>7}{capped:>8.1%}{accuracy:>10.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
