"""The sandbox and the code reward against hostile programs: each scores 0, its outcome is counted, and the
machine, the run folder and this process are unharmed. Runs real sandboxed processes (bubblewrap where it
works, else unshare), a few seconds in all; ``MUGRPO_SANDBOX=unshare`` tests the fallback."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from mugrpo_async.rewards import code, sandbox
from mugrpo_async.rewards.code import extract_program, reward
from mugrpo_async.rewards.sandbox import Limits, run_python

LIMITS = dict(timeout_s=2.0, cpu_s=1.0, memory_mb=512, nproc=16, file_mb=4)
TESTS = ["assert f(2) == 4", "assert f(5) == 10"]
REPO = Path(__file__).resolve().parents[1]
CHECKPOINT = REPO / ".cache" / "sandbox-test" / "checkpoints" / "model.safetensors"
HOME_FILE = Path.home() / ".mugrpo-sandbox-test"


@pytest.fixture(scope="module", autouse=True)
def checkpoint():
    """A file standing for a checkpoint and one in the home directory, readable by everyone on the host."""
    CHECKPOINT.parent.mkdir(parents=True, exist_ok=True)
    CHECKPOINT.write_text("weights")
    CHECKPOINT.chmod(0o644)
    HOME_FILE.write_text("secret")
    HOME_FILE.chmod(0o644)
    yield CHECKPOINT
    HOME_FILE.unlink(missing_ok=True)


F = "\ndef f(x):\n    return 2*x"  # would pass the tests, had what comes before it worked
HOSTILE = {
    "infinite loop": "while True:\n    pass",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "memory hog": "blocks = []\nwhile True:\n    blocks.append(bytearray(2**26))",
    "network connection": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)" + F,
    "writing outside its directory": f"open({str(REPO / 'SANDBOX_ESCAPE')!r}, 'w').write('x')" + F,
    "reading the run folder": f"print(open({str(REPO / 'README.md')!r}).read())" + F,
    "reading the checkpoints": f"print(open({str(CHECKPOINT)!r}).read())" + F,
    "reading the home directory": f"print(open({str(HOME_FILE)!r}).read())" + F,
    "killing its parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)",
    "printing gigabytes": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
    "closing stdout early": "import os\nos.close(1)\nos.close(2)\nos._exit(0)",
    "syntax error": "def f(x:\n    return 2*x",
    "never reads its input": "import time\ntime.sleep(30)",
}


def test_extract_program_takes_the_last_python_block_or_the_whole_response():
    assert extract_program("a\n```python\nx = 1\n```\nb\n```python\ny = 2\n```") == "y = 2\n"
    assert extract_program("```\nz = 3\n```") == "z = 3\n"
    assert extract_program("def f(x):\n    return x") == "def f(x):\n    return x"


def test_a_correct_program_scores_one_and_partial_gives_the_passing_fraction():
    right = "```python\ndef f(x):\n    return 2 * x\n```"
    half = "```python\ndef f(x):\n    return 4 if x == 2 else 0\n```"
    meta = [{"tests": TESTS}] * 2
    assert reward(["", ""], [right, half], ["", ""], meta, **LIMITS) == [1.0, 0.0]
    assert reward(["", ""], [right, half], ["", ""], meta, partial=True, **LIMITS) == [1.0, 0.5]
    stub = {"tests": TESTS, "prefix": "def f(x):\n"}  # a completion continues the stub
    assert reward([""], ["    return x + x\n"], [""], [stub], **LIMITS) == [1.0]


@pytest.mark.slow  # real processes up to the limits (a fork bomb among them): the integration tier
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_scores_zero_and_harms_nothing(name):
    before = dict(code.OUTCOME_COUNTS)
    t0 = time.monotonic()
    rewards = reward([""], [HOSTILE[name]], [""], [{"tests": TESTS}], **LIMITS)
    took = time.monotonic() - t0
    assert rewards == [0.0] and took < LIMITS["timeout_s"] + 5
    assert sum(code.OUTCOME_COUNTS.values()) == sum(before.values()) + 1  # counted once, under its outcome
    assert not (REPO / "SANDBOX_ESCAPE").exists()
    assert not _leftovers() or (time.sleep(1) or not _leftovers())  # no sandbox process outlives its run


def _leftovers() -> list[Path]:
    """Processes of this process's sandbox uids (as root each run gets one: sandbox._UID_BASE + pid slot)."""
    first = sandbox._UID_BASE + (os.getpid() % 10_000) * 16
    return [p for p in Path("/proc").iterdir() if p.name.isdigit() and first <= _uid(p) < first + 16 and _alive(p)]


def _uid(path: Path) -> int:
    try:
        return path.stat().st_uid
    except OSError:
        return -1


def _alive(path: Path) -> bool:
    """Not a zombie (an exited bwrap parent waits there for the container's init to reap it)."""
    try:
        return "State:\tZ" not in (path / "status").read_text()
    except OSError:
        return False


@pytest.mark.slow
def test_limits_end_each_run_with_its_outcome():
    fast = Limits(cpu_s=1, wall_s=2, memory_mb=256, nproc=8, file_mb=1)
    assert run_python({"m.py": "print(6 * 7)"}, "m.py", fast).stdout == "42\n"
    assert run_python({"m.py": "x = bytearray(2**30)"}, "m.py", fast).outcome == "memory_limit"
    assert run_python({"m.py": "print('x' * 2**21)"}, "m.py", fast).outcome == "output_limit"
    assert run_python({"m.py": "import time\ntime.sleep(9)"}, "m.py", fast).outcome == "timeout"
    net = run_python({"m.py": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)"}, "m.py", fast)
    assert net.outcome == "error" and ("unreachable" in net.stderr or "OSError" in net.stderr)
    home = run_python({"m.py": f"print(open({str(REPO / 'README.md')!r}).read()[:9])"}, "m.py", fast)
    assert home.outcome == "error" and "mu-GRPO" not in home.stdout
    assert os.getpid() and socket.gethostname()  # this process is alive and well


def test_backend_is_one_of_the_two():
    assert sandbox.backend() in ("bwrap", "unshare")


def test_a_working_dir_and_hidden_path_under_tmp_stay_unseen_and_the_program_runs(tmp_path, monkeypatch):
    secret = tmp_path / "run"  # pytest's tmp_path lies under /tmp, which the sandbox replaces
    secret.mkdir()
    monkeypatch.chdir(tmp_path)  # a checkout under /tmp: the working dir is one of the hidden paths
    program = f"import os; print(os.path.exists({str(secret)!r}), os.path.exists({str(tmp_path)!r}))"
    r = run_python({"main.py": program}, "main.py", Limits(cpu_s=5), hidden=[str(secret)])
    assert (r.outcome, r.stdout.strip()) == ("ok", "False False"), r
