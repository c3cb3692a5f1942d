"""Code reward: the response's program runs against the problem's tests in the sandbox.

The program is the last fenced ```python block of the response (any fenced block when none is marked
python), or the whole response when it has none; a problem whose metadata holds ``prefix`` (HumanEval's
function stub with its imports) gets it in front, so a completion continues the stub and a full function
replaces it. Reward 1.0 when every test of ``metadata["tests"]`` passes, else 0.0; with ``partial=True`` the
passing fraction. A test has one of three forms (:mod:`mugrpo_async.rewards.verdicts`):

- ``{"input": str, "output": str}`` (stdin/stdout, as code_contests): the program runs as a script
  (``__main__``) with the input on its standard input; its standard output is compared with ``output`` here,
  outside the sandbox, token by token. **Unforgeable**: ``output`` never enters the sandbox.
- ``"assert <expr> == <literal>"`` (value): the sandbox evaluates ``<expr>`` in the program's namespace and
  reports the value in a tagged encoding of builtin types only; it is compared with the literal here, types
  included. **Unforgeable**: the literal never enters the sandbox. The synthetic code task's tests have it.
- any other snippet (HumanEval's ``check`` function and ``check(f)``): runs in the program's own interpreter,
  which reports the pass. **Forgeable**: a program can write that report itself (it can read the token from
  the harness), patch builtins, or return an object whose ``__eq__`` is always true. Use it for evaluation
  only; train on the first two forms.

A harness runs in one sandbox per program (:mod:`mugrpo_async.rewards.sandbox`): one sandbox start (tens of
ms) per program, not per test. It runs each stdin/stdout test as the script ``__main__`` in a forked copy of
itself, made before any of the program ran (no interpreter start per test; its own session, killed with its
group at ``test_timeout_s``, its own CPU limit), then, when there are other tests, runs the program with its
standard output sent to ``/dev/null`` and evaluates each. It reports one line per test,
tagged with a random token read from its input. Whatever the program does to that report (it can forge any
line), a line of the first two forms only states what the program answered. Outcomes are counted per
process (:data:`OUTCOME_COUNTS`) and logged.

    reward(["p"], ["```python\\ndef f(x):\\n    return 2 * x\\n```"], [""], [{"tests": ["assert f(2) == 4"]}])  # [1.0]
    reward(["p"], ["print(sum(map(int, input().split())))"], [""], [{"tests": [{"input": "1 2", "output": "3"}]}])
"""

from __future__ import annotations

import collections
import json
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mugrpo_async.rewards.sandbox import Limits, run_python
from mugrpo_async.rewards.verdicts import classify, parse_report, passes

log = logging.getLogger(__name__)

OUTCOME_COUNTS: collections.Counter = collections.Counter()
"""Programs scored by this process per outcome: ``passed``, ``failed`` (tests ran, some failed), ``program_error``
(the program raised: a syntax error, a refused allocation, connection or file), ``no_result`` (the harness
reported nothing: the program exited, closed its output or killed the harness) and the sandbox's outcomes
(``timeout``, ``cpu_limit``, ``memory_limit``, ``output_limit``, ``killed``, ``error``)."""

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

HARNESS = r"""
import base64, json, os, runpy, select, sys, time
token = sys.stdin.readline().strip()
report = os.dup(1)
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
sys.stdin = open(os.devnull)
job = json.load(open("tests.json"))


def emit(i, kind, payload=b""):
    tail = " " + base64.b64encode(payload).decode() if payload else ""
    os.write(report, ("\n%s %d %s%s\n" % (token, i, kind, tail)).encode())


def script(fin, fout):
    # A forked copy of this harness (no interpreter start) becomes `python solution.py`: its own session,
    # the test's input and output files, no report descriptor, no token.
    os.setsid()
    os.dup2(fin, 0)
    os.dup2(fout, 1)
    os.dup2(null, 2)
    os.close(report)
    globals().pop("token")
    sys.stdin = open(0, closefd=False)
    sys.argv = ["solution.py"]
    code = 0
    try:
        runpy.run_path("solution.py", run_name="__main__")
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 0 if err.code is None else 1
    except BaseException:
        code = 1
    try:
        sys.stdout.flush()
    except BaseException:
        code = 1
    os._exit(code)


def wait(pid, timeout):
    try:
        fd = os.pidfd_open(pid)
        ready = select.select([fd], [], [], timeout)[0]
        os.close(fd)
        return os.waitpid(pid, 0)[1] if ready else None
    except (AttributeError, OSError):  # no pidfd: poll
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            time.sleep(0.002)
        return None


def run_io(i, text):
    with open(".in", "w") as f:
        f.write(text)
    with open(".in", "rb") as fin, open(".out-io", "wb") as fout:
        pid = os.fork()
        if pid == 0:
            try:
                script(fin.fileno(), fout.fileno())
            finally:
                os._exit(1)
        status = wait(pid, job["timeout_s"])
        try:
            os.killpg(pid, 9)
        except OSError:
            pass
        if status is None:
            os.waitpid(pid, 0)
    with open(".out-io", "rb") as f:
        out = f.read(job["output_bytes"] + 1)
    kind = "timeout" if status is None else "ok" if status == 0 else "exit"
    if len(out) > job["output_bytes"]:
        kind = "long"
    emit(i, kind, out if kind == "ok" else b"")


def enc(v):
    t = type(v)
    if t is bool:
        return ["bool", v]
    if t is int:
        return ["int", str(v)]
    if t is float:
        return ["float", repr(v)]
    if t is str:
        return ["str", v]
    if v is None:
        return ["none"]
    if t is list or t is tuple:
        return [t.__name__, [enc(x) for x in v]]
    if t is dict:
        return ["dict", [[enc(k), enc(x)] for k, x in v.items()]]
    raise TypeError("not a builtin value: " + t.__name__)


tests = list(enumerate(job["tests"]))
for i, test in tests:
    if test["kind"] == "io":
        try:
            run_io(i, test["input"])
        except BaseException as err:
            emit(i, "error")
            print("test", i, ":", type(err).__name__, err, file=sys.stderr)
inside = [(i, t) for i, t in tests if t["kind"] != "io"]
if inside:
    ns = {"__name__": "solution"}
    try:
        exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
        emit(-1, "load")
    except BaseException as err:
        inside = []
        print("program:", type(err).__name__, err, file=sys.stderr)
for i, test in inside:
    try:
        if test["kind"] == "value":
            value = eval(compile(test["expr"], "test-%d" % i, "eval"), dict(ns))
            emit(i, "value", json.dumps(enc(value)).encode())
        else:
            exec(compile(test["code"], "test-%d" % i, "exec"), dict(ns))
            emit(i, "pass")
    except BaseException as err:
        emit(i, "fail")
        print("test", i, ":", type(err).__name__, err, file=sys.stderr)
emit(-2, "done")
"""


def extract_program(response: str) -> str:
    """The last ```python block (else the last fenced block), or the whole response when there is none."""
    blocks = _FENCE.findall(response)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if python or blocks:
        return (python or [code for _, code in blocks])[-1]
    return response


def run_tests(
    program: str, tests: Sequence, limits: Limits, test_timeout_s: float | None = None, output_kb: int = 1024
) -> tuple[int, str, str]:
    """Run ``program`` against ``tests`` in one sandbox; returns ``(passing tests, outcome, detail)``.

    Each stdin/stdout test runs the program afresh (``test_timeout_s`` wall seconds each, default
    ``limits.cpu_s``; standard output kept up to ``output_kb`` KiB, more fails the test). ``outcome`` is
    ``passed``, ``failed``, ``program_error`` (the program raised before an in-process test: ``detail`` is its
    exception), ``no_result`` or the sandbox's outcome (:data:`~mugrpo_async.rewards.sandbox.OUTCOMES`) when
    the harness did not finish.

    Raises:
        ValueError: a test of no known form (:func:`~mugrpo_async.rewards.verdicts.classify`).
    """
    kinds, specs = zip(*(classify(t) for t in tests)) if tests else ((), ())
    token = secrets.token_hex(16)
    job = {"tests": specs, "timeout_s": test_timeout_s or limits.cpu_s, "output_bytes": output_kb * 1024}
    files = {"main.py": HARNESS, "solution.py": program, "tests.json": json.dumps(job)}
    whole = replace(limits, output_kb=max(limits.output_kb, limits.file_mb * 1024))  # the report, read whole
    result = run_python(files, "main.py", whole, stdin=token + "\n")
    report = parse_report(result.stdout, token)
    passed = sum(passes(t, k, report.get(i)) for i, (t, k) in enumerate(zip(tests, kinds)))
    lines = result.stderr.splitlines()
    detail = next((ln[len("program: ") :] for ln in lines if ln.startswith("program: ")), "")
    if -2 not in report and passed < len(tests):
        outcome = result.outcome if result.outcome != "ok" else "no_result"
        return passed, outcome, detail or result.stderr[-200:]
    if -1 not in report and any(k != "io" for k in kinds):
        return passed, "program_error", detail
    return passed, "passed" if passed == len(tests) else "failed", detail


def score_one(response: str, metadata: dict, limits: Limits, partial: bool = False, **run: Any) -> float:
    """The reward of one response (see the module docstring); ``run``: :func:`run_tests`' keywords."""
    tests = metadata.get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError("code reward: metadata['tests'] must be a non-empty list of tests")
    program = extract_program(response)
    prefix = metadata.get("prefix")
    if prefix:
        program = prefix + ("\n\n" if program is not response else "") + program
    try:
        passed, outcome, _ = run_tests(program, tests, limits, **run)
    except ValueError as err:
        raise ValueError(f"code reward: metadata['tests']: {err}") from None
    OUTCOME_COUNTS[outcome] += 1
    if outcome not in ("passed", "failed", "program_error"):
        log.info("code reward: program ended as %s (%s)", outcome, dict(OUTCOME_COUNTS))
    return passed / len(tests) if partial else float(passed == len(tests))


def reward(
    prompts: Sequence[str],
    responses: Sequence[str],
    references: Sequence[str],
    metadata: Sequence[dict],
    *,
    timeout_s: float = 10.0,
    partial: bool = False,
    cpu_s: float = 5.0,
    memory_mb: int = 1024,
    nproc: int = 16,
    file_mb: int = 16,
    test_timeout_s: float | None = None,
    output_kb: int = 1024,
) -> list[float]:
    """The ``reward.function`` ``mugrpo_async.rewards.code:reward``: 1.0 per response whose program passes all
    its tests (``partial``: the passing fraction). ``reward.timeout_s`` is each program's wall limit, all its
    tests together; ``test_timeout_s`` and ``output_kb`` bound each stdin/stdout test (:func:`run_tests`); the
    other keywords (``reward.options``) are the sandbox's limits (:class:`~mugrpo_async.rewards.sandbox.Limits`).
    """
    limits = Limits(cpu_s=min(cpu_s, timeout_s), wall_s=timeout_s, memory_mb=memory_mb, nproc=nproc, file_mb=file_mb)
    run = {"test_timeout_s": test_timeout_s, "output_kb": output_kb}
    return [score_one(r, m, limits, partial, **run) for r, m in zip(responses, metadata)]


reward.uses_context = True  # metadata (the tests) matters: the memo keys pairs by it too
