"""Sandboxed code reward: programs scored per second, and the outcome of each hostile program.

Scores a batch of typical short programs with ``mugrpo_async.rewards.code.score_one`` in W worker processes
(W = 1 and 2: the CPU box has 2 cores), each a full sandbox start (bubblewrap or unshare,
:mod:`mugrpo_async.rewards.sandbox`); half of them wrong. Two forms: ``value`` (a one-line function and two
value asserts, as the synthetic code task makes) and ``io`` with T stdin/stdout tests (a script reading two
numbers, as code_contests problems are; each test a fresh interpreter inside the one sandbox). Then runs every
hostile program of ``tests/test_sandbox.py`` once and prints its outcome as a markdown table.

    .venv/bin/python -m bench.sandbox_throughput [--programs 200] [--workers 1,2] [--io-tests 2,10]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor

from mugrpo_async.rewards import code, sandbox
from mugrpo_async.rewards.sandbox import Limits

LIMITS = Limits(cpu_s=1.0, wall_s=2.0, memory_mb=512, nproc=16, file_mb=4)


def _program(k: int, io_tests: int = 0) -> tuple[str, dict]:
    """Program ``k``: value form (``io_tests`` 0) or a script with ``io_tests`` stdin/stdout tests."""
    a, b = k % 7 + 2, k % 5
    body = f"x*{a}+{b}" if k % 2 == 0 else f"x*{a}-{b}"  # odd k: wrong whenever b > 0
    if io_tests:
        tests = [{"input": f"{x}\n", "output": f"{x * a + b}\n"} for x in range(3, 3 + io_tests)]
        return f"```python\nx = int(input())\nprint({body})\n```", {"tests": tests}
    meta = {"tests": [f"assert f(3) == {3 * a + b}", f"assert f(10) == {10 * a + b}"]}
    return f"```python\ndef f(x): return {body}\n```", meta


def _score(job: tuple[int, int]) -> float:
    response, meta = _program(*job)
    return code.score_one(response, meta, LIMITS)


def throughput(programs: int, workers: int, io_tests: int = 0) -> tuple[float, float]:
    """(programs per second, mean reward) over ``programs`` programs in ``workers`` processes."""
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_score, [(k, io_tests) for k in range(workers)]))  # start the workers
        t0 = time.perf_counter()
        rewards = list(pool.map(_score, [(k, io_tests) for k in range(programs)], chunksize=4))
        took = time.perf_counter() - t0
    return programs / took, sum(rewards) / len(rewards)


def hostile_table() -> list[str]:
    from tests.test_sandbox import HOSTILE, TESTS

    rows = ["| program | reward | outcome | what it met | wall s |", "|---|---|---|---|---|"]
    for name, program in HOSTILE.items():
        t0 = time.perf_counter()
        passed, outcome, detail = code.run_tests(program, TESTS, LIMITS)
        took = time.perf_counter() - t0
        reward = float(passed == len(TESTS))
        detail = detail.strip().replace("|", "/")[:90]
        rows.append(f"| {name} | {reward:.0f} | {outcome} | {detail} | {took:.2f} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--programs", type=int, default=200)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--io-tests", default="2,10", help="stdin/stdout tests per program, each measured")
    args = p.parse_args(argv)
    print(f"backend: {sandbox.backend()}, limits: {LIMITS}")
    print("| form | workers | programs | programs/s | mean reward |\n|---|---|---|---|---|")
    for io_tests in [0, *(int(x) for x in args.io_tests.split(",") if x)]:
        form = f"io, {io_tests} tests" if io_tests else "value, 2 tests"
        for w in [int(x) for x in args.workers.split(",")]:
            rate, mean = throughput(args.programs, w, io_tests)
            print(f"| {form} | {w} | {args.programs} | {rate:.1f} | {mean:.3f} |")
    print("\n".join(hostile_table()))


if __name__ == "__main__":
    main()
