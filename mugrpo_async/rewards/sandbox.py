"""Run an untrusted Python program in a sandbox: limited CPU, wall time, memory, processes and file size; no
network; a private temporary directory; the run folder, the home directory and the rest of the host unseen.

Two backends, picked once per process (:func:`backend`; ``MUGRPO_SANDBOX=bwrap|unshare`` forces one):

- ``bwrap`` (bubblewrap, Debian's ``bubblewrap``): a new mount, user, PID, network, IPC and UTS namespace
  whose filesystem holds only ``/usr``, ``/lib*``, ``/bin`` and the interpreter's own folder, all read-only,
  a fresh ``/proc`` and ``/dev``, a private ``/tmp``, and the program's folder (the one writable place).
- ``unshare`` (util-linux, when bubblewrap is missing or cannot start): new mount, PID and network
  namespaces (as root; otherwise also a user namespace), a fresh ``/proc``, tmpfs over ``/tmp``, ``/var/tmp``,
  ``/dev/shm``, the home directories and the hidden paths (the run folder, the working dir); the rest of the
  host filesystem stays visible, read-only to the program only where its permissions say so.

In both, the program runs as an unprivileged user of its own (a fresh uid per run when started as root, so
that ``RLIMIT_NPROC`` counts this run's processes alone), in a new session, under ``setrlimit`` limits set
before it starts (CPU seconds, address space, processes, file size, no core files); its stdout and stderr
go to files in its folder, cut by the file-size limit; at the wall limit its whole process group (and with
it the PID namespace) is killed. docs/REWARDS.md lists what each backend stops and how.

    result = run_python({"main.py": "print(1)"}, "main.py", Limits(cpu_s=2))
    result.outcome, result.stdout  # ("ok", "1\\n")
"""

from __future__ import annotations

import itertools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

OUTCOMES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed")
"""What a run can end as: exit 0, a non-zero exit, the wall limit, the CPU limit, a failed allocation,
the file-size limit (stdout/stderr included), any other signal."""

_UID_BASE = 200_000  # sandbox uids (no passwd entry needed): base + (pid % 10_000) * 16 + run % 16
_runs = itertools.count()


@dataclass(frozen=True)
class Limits:
    """Per-run limits.

    Attributes:
        cpu_s: CPU seconds (RLIMIT_CPU; SIGXCPU, then SIGKILL one second later).
        wall_s: Wall-clock seconds before the process group is killed.
        memory_mb: Address space per process in MiB (RLIMIT_AS).
        nproc: Processes and threads of the run's user (RLIMIT_NPROC).
        file_mb: Largest file it may write, stdout and stderr included, in MiB (RLIMIT_FSIZE).
        output_kb: Leading KiB of stdout and stderr kept in the result.
    """

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 1024
    nproc: int = 16
    file_mb: int = 16
    output_kb: int = 64


@dataclass(frozen=True)
class RunResult:
    """One run: ``outcome`` (one of :data:`OUTCOMES`), the exit status, the heads of stdout and stderr."""

    outcome: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    backend: str


def _python_exe() -> str:
    """The interpreter programs run with: the system's ``/usr/bin/python3`` when there is one, else the base
    interpreter of this one (never the virtual environment: programs get the standard library alone)."""
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    v = sys.version_info
    exe = Path(sys.base_prefix) / "bin" / f"python{v.major}.{v.minor}"
    return str(exe if exe.exists() else Path(sys.executable).resolve())


def _python_prefix() -> str | None:
    """The interpreter's folder when it lies outside ``/usr`` (then bound into the sandbox), else None."""
    exe = _python_exe()
    return None if exe.startswith("/usr/") else str(Path(exe).parent.parent)


def _bwrap_cmd(box: Path, argv: list[str], prefix_fd: int | None) -> list[str]:
    prefix = _python_prefix()
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
    for path in ("/usr", "/bin", "/lib", "/lib64", "/lib32", "/sbin"):
        if os.path.exists(path):
            cmd += ["--ro-bind", path, path]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    if prefix and prefix_fd is not None:  # by an fd opened before dropping privileges: its parents may be 0700;
        cmd += ["--ro-bind-fd", str(prefix_fd), prefix]  # after /tmp's tmpfs, which would hide a prefix under it
    cmd += ["--bind", str(box), "/box", "--chdir", "/box"]
    cmd += ["--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/box", "--setenv", "PYTHONHASHSEED", "0"]
    return cmd + ["--remount-ro", "/", "--", *argv]  # its root read-only too: /box and /tmp are the writable places


def _unshare_cmd(box: Path, argv: list[str], hidden: list[str], uid: int | None) -> list[str]:
    """unshare + a shell that hides paths with tmpfs mounts, binds the program's folder to /mnt and drops to
    ``uid`` (when root) before exec'ing the program."""
    prefix = _python_prefix()
    steps = ["set -e", f"mount --bind {_q(str(box))} /mnt"]
    if prefix:
        steps.append(f"mkdir -p /mnt/.py && mount --bind {_q(prefix)} /mnt/.py")
    private = [p for p in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(p)]
    masked = [p for p in dict.fromkeys(["/root", "/home", os.path.expanduser("~"), *hidden])
              if os.path.isdir(p) and not _under(p, private)]  # under /tmp: gone with it  # fmt: skip
    for path in private + masked:
        steps.append(f"mount -t tmpfs -o size=16m,mode=1777 none {_q(path)}")
    if prefix:
        steps.append(f"mkdir -p {_q(prefix)} && mount --bind /mnt/.py {_q(prefix)} && umount -l /mnt/.py")
    steps += [f"mount -o remount,ro,bind {_q(path)}" for path in masked]  # hidden and not writable either
    steps.append("cd /mnt")
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"] if uid else []
    env = ["env", "-i", "PATH=/usr/bin:/bin", "HOME=/mnt", "PYTHONHASHSEED=0"]
    # Not exec'd: the shell stays PID 1 of the namespace, which ignores signals it has no handler for, so the
    # program (PID 2) gets SIGXCPU and cannot signal its parent.
    steps.append(" ".join(_q(a) for a in [*drop, *env, *argv]) + "; exit $?")
    ns = ["--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--propagation", "private"]
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, *ns, "sh", "-c", "; ".join(steps)]


def _under(path: str, parents: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == p or real.startswith(p.rstrip("/") + "/") for p in map(os.path.realpath, parents))


def _q(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _limit_setter(limits: Limits, uid: int | None):
    """``preexec_fn``: the limits in place before anything of the program runs (bwrap: before bwrap itself)."""
    memory = limits.memory_mb * 2**20
    cpu = max(1, int(limits.cpu_s + 0.999))
    file_size = limits.file_mb * 2**20

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.nproc, limits.nproc))
        if uid is not None and _backend_name() == "bwrap":  # bwrap then builds its user namespace as uid
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return apply


def _nproc_limit(limits: Limits, uid: int | None) -> Limits:
    """Without a uid of its own, RLIMIT_NPROC counts every process of the user: add those running now."""
    if uid is not None:
        return limits
    mine = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and _owner(p) == os.getuid())
    return Limits(**{**limits.__dict__, "nproc": limits.nproc + mine + 8})


def _owner(path: Path) -> int | None:
    try:
        return path.stat().st_uid
    except OSError:
        return None


@cache
def _backend_name() -> str:
    forced = os.environ.get("MUGRPO_SANDBOX", "")
    if forced in ("bwrap", "unshare"):
        return forced
    if shutil.which("bwrap"):
        probe = ["bwrap", "--unshare-all", "--ro-bind", "/", "/", "--", "/bin/true"]
        if subprocess.run(probe, capture_output=True, timeout=30).returncode == 0:
            return "bwrap"
    return "unshare"


def backend() -> str:
    """The backend this process uses: ``bwrap`` where bubblewrap starts, else ``unshare``."""
    return _backend_name()


def run_python(
    files: dict[str, str], main: str, limits: Limits = Limits(), stdin: str = "", hidden: list[str] | None = None
) -> RunResult:
    """Write ``files`` into a fresh private folder and run ``python -I main`` there in the sandbox.

    Args:
        files: file name -> text, written into the program's folder.
        main: the file to run.
        limits: the run's limits.
        stdin: the program's standard input (a file: a program that never reads it cannot block the caller).
        hidden: more paths to hide (``unshare`` backend; bwrap shows nothing it is not given).

    Returns:
        The :class:`RunResult`; never raises for anything the program does.
    """
    name = _backend_name()
    uid = _UID_BASE + (os.getpid() % 10_000) * 16 + next(_runs) % 16 if os.geteuid() == 0 else None
    limits = _nproc_limit(limits, uid)
    with tempfile.TemporaryDirectory(prefix="mugrpo-sbx-") as tmp:
        box = Path(tmp) / "box"
        box.mkdir()
        for fname, text in {**files, ".stdin": stdin}.items():
            (box / fname).write_text(text)
        if uid is not None:
            os.chmod(tmp, 0o755)
            for path in (box, *box.iterdir()):
                os.chown(path, uid, uid)
        argv = [_python_exe(), "-I", "-B", main]
        prefix = _python_prefix() if name == "bwrap" else None
        fd = os.open(prefix, os.O_RDONLY | os.O_DIRECTORY) if prefix else None
        try:
            if name == "bwrap":
                cmd = _bwrap_cmd(box, argv, fd)
            else:
                cmd = _unshare_cmd(box, argv, [os.getcwd(), *(hidden or [])], uid)
            return _execute(cmd, box, limits, uid, name, () if fd is None else (fd,))
        finally:
            if fd is not None:
                os.close(fd)


def _execute(cmd: list[str], box: Path, limits: Limits, uid: int | None, name: str, fds: tuple) -> RunResult:
    t0 = time.monotonic()
    with open(box / ".stdin", "rb") as fin, open(box / ".out", "wb") as fout, open(box / ".err", "wb") as ferr:
        proc = subprocess.Popen(
            cmd,
            stdin=fin,
            stdout=fout,
            stderr=ferr,
            start_new_session=True,
            pass_fds=fds,
            preexec_fn=_limit_setter(limits, uid),
        )
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc.pid)
        proc.wait()
    wall = time.monotonic() - t0
    out, err = _head(box / ".out", limits.output_kb), _head(box / ".err", limits.output_kb)
    return RunResult(_outcome(proc.returncode, timed_out, err), proc.returncode, out, err, wall, name)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _head(path: Path, kb: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(kb * 1024).decode("utf-8", "replace")
    except OSError:
        return ""


def _outcome(code: int | None, timed_out: bool, stderr: str) -> str:
    """Classify an exit: a signal number comes back as ``-sig`` (or ``128 + sig`` through a shell)."""
    if timed_out:
        return "timeout"
    if code == 0:
        return "ok"
    sig = -code if code is not None and code < 0 else code - 128 if code and code > 128 else None
    if sig == signal.SIGXCPU:
        return "cpu_limit"
    if sig == signal.SIGXFSZ or "File too large" in stderr:  # Python ignores SIGXFSZ: the write fails instead
        return "output_limit"
    if "MemoryError" in stderr:
        return "memory_limit"
    if sig is not None:
        return "killed"
    return "error"
