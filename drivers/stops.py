"""How a run stops when it cannot go on: one exception type, one message, exit code 3.

Every actor's death that the run does not survive (a trainer rank, the sample queue, a rollout worker past
its restarts in async mode or the last one in sync mode, any other actor), a generation (or evaluation
share) that keeps failing, a minibatch that never comes and a streak of non-finite updates all end as
:class:`RunStopped`: it names the cause and the newest checkpoint, and ``launch.train`` prints it as one
line with the command that resumes the run (the same command; ``run.resume=auto`` continues from that
checkpoint). Ray-free.
"""

from __future__ import annotations

import shlex
from pathlib import Path


class RunStopped(RuntimeError):
    """The run stopped; running the same command again resumes it from ``checkpoint`` (None: from the start)."""

    def __init__(self, reason: str, checkpoint: Path | None = None):
        super().__init__(reason)
        self.reason, self.checkpoint = reason, checkpoint

    def __str__(self) -> str:
        return (f"{self.reason}; newest checkpoint: {self.checkpoint or 'none'}. Resume with the same command "
                "(run.resume=auto), or add --resume")  # fmt: skip

    def describe(self, command: str) -> str:
        """The one line the CLI prints: cause, newest checkpoint, the command that resumes."""
        where = self.checkpoint or "none (the run starts again from update 0)"
        return f"the run stopped: {self.reason}; newest checkpoint: {where}; resume with: {command}"


class TrainerFailed(RunStopped):
    """A trainer rank died."""


class RolloutFailed(RunStopped):
    """Generation cannot continue (no live worker, a chunk failed every retry, a worker loop failed)."""


class NonfiniteUpdates(RunStopped):
    """``trainer.max_nonfinite_updates`` updates in a row had a non-finite loss or gradient norm."""


def brief(err: BaseException) -> str:
    """An error in one line, without its traceback: for a task's error (``RayTaskError``) what it wraps."""
    cause = getattr(err, "cause", None)
    inner = cause if isinstance(cause, BaseException) and cause is not err else err
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    if type(inner).__module__.startswith("ray.") or not lines:
        return type(inner).__name__  # Ray's own messages run over many lines (ids, pids, hints)
    return f"{type(inner).__name__}: {lines[0]}"


def resume_command(argv: list[str], resume_policy: str, program: list[str] | None = None) -> str:
    """The command line that resumes a stopped run: the one that was run (``program + argv``).

    ``program`` is how the entry point was started (default ``python -m launch.train``). Under
    ``run.resume=never`` the same command would refuse the folder, so ``run.resume=auto`` is appended.
    """
    words = [*(program or ["python", "-m", "launch.train"]), *argv]
    if resume_policy == "never":
        words.append("run.resume=auto")
    return shlex.join(words)
