"""A run's live status: one short line for the job log and for ``python -m launch.watch``.

The driver keeps a :class:`StatusBoard`: the update loop feeds it every update record and what the rollout side
produced; every ``logging.status_every_s`` seconds a background thread logs :func:`format_status` of it (the job
log, which the Ray dashboard's Jobs page shows) and writes ``<output_dir>/status.json``, which ``launch.watch``
reads (:func:`load_status`; without it, the status is rebuilt from ``metrics.jsonl``). Ray-free.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from mugrpo_async.rollout.shards import atomic_write

STATUS_FILE = "status.json"
STATES = ("running", "finished", "stopped")


@dataclass
class RunStatus:
    """What the status line shows.

    Counts are cumulative over the run: async mode takes them from the sample queue (its counters survive a
    resume); sync mode counts the groups its stages generate in this process, and served = updates x B_mini.
    ``queue_depth`` is None in sync mode (no queue); ``idle_ratio`` and the lags are None before the first update.
    """

    run: str
    mode: str
    total_updates: int
    groups_per_update: int
    updates: int = 0
    idle_ratio: float | None = None
    lag_mean: float | None = None
    lag_max: int | None = None
    queue_depth: int | None = None
    generated: int = 0
    served: int = 0
    dropped: int = 0
    filtered: int = 0  # async dynamic sampling: equal-reward groups filtered at the queue
    tokens: int = 0  # response tokens generated
    t_wall_s: float = 0.0  # run wall time at the snapshot
    state: str = "running"  # one of STATES
    every_s: float = 0.0  # how often the driver writes the status (0: only at the end)
    written_at: float = 0.0  # unix time of the snapshot

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunStatus:
        """Inverse of ``asdict``; unknown keys are ignored (a newer writer), missing ones keep their defaults."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _num(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_duration(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``3725`` -> ``1h02m``; below a minute ``42s``."""
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_status(s: RunStatus) -> str:
    """One short line: ``run [mode] update u/N | idle r | lag mean (max m) | queue q | groups ... | wall``."""
    parts = [
        f"{s.run} [{s.mode}] update {s.updates}/{s.total_updates}",
        f"idle {_num(s.idle_ratio, '.3f')}",
        f"lag {_num(s.lag_mean, '.2f')} (max {_num(s.lag_max, 'd')})",
    ]
    if s.queue_depth is not None:
        parts.append(f"queue {s.queue_depth}")
    parts.append(f"groups generated {s.generated} served {s.served} dropped {s.dropped}"
                 + (f" filtered {s.filtered}" if s.filtered else ""))  # fmt: skip
    parts.append(format_duration(s.t_wall_s) + ("" if s.state == "running" else f" {s.state}"))
    return " | ".join(parts)


def status_from_records(records: list[dict[str, Any]], run: str, mode: str, groups_per_update: int,
                        total_updates: int) -> RunStatus:  # fmt: skip
    """The status that ``metrics.jsonl``'s records give (a run that writes no status.json)."""
    s = RunStatus(run=run, mode=mode, total_updates=total_updates, groups_per_update=groups_per_update)
    for r in records:
        kind = r.get("kind")
        if kind == "update":
            _apply_update(s, r, from_file=True)
            s.t_wall_s = r.get("t_wall_s", s.t_wall_s)
        elif kind == "stage":
            s.generated += int(r.get("groups", 0))
            s.tokens += int(r.get("response_tokens", 0))
        elif kind == "end":
            s.state = "finished"
            s.t_wall_s = r.get("T_total", s.t_wall_s)
            for key, name in (("generated", "generated"), ("served", "served"), ("dropped", "dropped"),
                              ("groups_filtered", "filtered")):  # fmt: skip
                if key in r:
                    setattr(s, name, int(r[key]))
    return s


def _apply_update(s: RunStatus, rec: dict[str, Any], from_file: bool = False) -> None:
    """Fold one update record into ``s``. An async record (it has ``queue_depth``) gives the queue's counts only
    when read back from the file (``from_file``): the driver's board has them from the queue itself."""
    s.updates = int(rec["update"])
    s.idle_ratio = rec.get("trainer_idle_ratio", s.idle_ratio)
    s.lag_mean = rec.get("lag_mean", s.lag_mean)
    s.lag_max = int(rec["lag_max"]) if "lag_max" in rec else s.lag_max
    if "queue_depth" not in rec:  # sync: every update serves B_mini groups of its stage
        s.served = s.updates * s.groups_per_update
    elif from_file:
        s.queue_depth, s.dropped = int(rec["queue_depth"]), int(rec.get("dropped", s.dropped))
        s.served += len(rec.get("group_uids", ()))
        s.filtered = int(rec.get("groups_filtered", s.filtered))


def write_status(run_dir: str | Path, s: RunStatus) -> Path:
    """Write ``<run_dir>/status.json`` atomically (a reader never sees half a file)."""
    path = Path(run_dir) / STATUS_FILE
    atomic_write(path, json.dumps(asdict(s)).encode())
    return path


def load_status(run_dir: str | Path) -> RunStatus | None:
    """The run folder's status: ``status.json`` if there is one, else rebuilt from ``metrics.jsonl`` and
    ``config.yaml``; an ``end`` record in ``metrics.jsonl`` marks it finished. None when the folder holds neither."""
    run_dir = Path(run_dir)
    records = _records(run_dir / "metrics.jsonl")
    try:
        s = RunStatus.from_dict(json.loads((run_dir / STATUS_FILE).read_text()))
    except (OSError, ValueError):
        s = None
    if s is None:
        if records is None:
            return None
        cfg = _config(run_dir / "config.yaml")
        sched = cfg.get("schedule", {})
        s = status_from_records(records, cfg.get("run", {}).get("name", run_dir.name), sched.get("mode", "?"),
                                int(sched.get("groups_per_update", 0)), int(sched.get("total_updates", 0)))  # fmt: skip
    if s.state == "running" and any(r.get("kind") == "end" for r in records or ()):
        s.state = "finished"
    return s


def _records(path: Path) -> list[dict[str, Any]] | None:
    """The JSON lines of ``path`` (a line being written, cut short, is left out); None when there is no file."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _config(path: Path) -> dict[str, Any]:
    import yaml

    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


class StatusBoard:
    """The driver's live :class:`RunStatus`: fed by the loops, logged and written every ``every_s`` seconds.

    ``emit(line)`` receives each status line (the driver's logger); ``on_change(status)`` is called after every
    change, e.g. to set gauges; ``elapsed()`` gives the run's wall time. Thread-safe.
    """

    def __init__(self, status: RunStatus, run_dir: str | Path, every_s: float, emit: Callable[[str], None],
                 elapsed: Callable[[], float], on_change: Callable[[RunStatus], None] | None = None):  # fmt: skip
        self.status, self.run_dir, self.every_s = replace(status, every_s=every_s), Path(run_dir), every_s
        self.emit, self.elapsed, self.on_change = emit, elapsed, on_change
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread: threading.Thread | None = None

    def observe_update(self, rec: dict[str, Any]) -> None:
        """An update record (``metrics.jsonl``'s ``kind: update``)."""
        self._change(lambda s: _apply_update(s, rec))

    def add(self, generated: int = 0, tokens: int = 0) -> None:
        """Sync mode: groups (and their response tokens) a stage has just generated."""

        def apply(s: RunStatus) -> None:
            s.generated, s.tokens = s.generated + generated, s.tokens + tokens

        self._change(apply)

    def set_queue(self, stats: dict[str, int]) -> None:
        """Async mode: the sample queue's counters (``put``, ``served``, ``dropped``, ``groups_filtered``,
        ``queue_depth``, ``tokens``)."""

        def apply(s: RunStatus) -> None:
            s.generated, s.served, s.dropped = stats["put"], stats["served"], stats["dropped"]
            s.filtered = stats.get("groups_filtered", 0)
            s.queue_depth, s.tokens = stats["queue_depth"], stats.get("tokens", s.tokens)

        self._change(apply)

    def snapshot(self) -> RunStatus:
        with self._lock:
            return replace(self.status, t_wall_s=self.elapsed(), written_at=time.time())

    def tick(self) -> str:
        """Log the status line and write status.json now; returns the line."""
        s = self.snapshot()
        line = format_status(s)
        self.emit(line)
        write_status(self.run_dir, s)
        return line

    def start(self) -> None:
        """Tick now (the run is up: its first line and status.json come before any update, however short the run),
        then every ``every_s`` seconds in a daemon thread (nothing when ``every_s`` is 0)."""
        if self.every_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="status", daemon=True)
            self._thread.start()

    def stop(self, state: str) -> None:
        """The run ended (``finished`` or ``stopped``): stop ticking and tick once more with that state. Only the
        first call counts (a finished run's close does not make it stopped)."""
        if state not in STATES:
            raise ValueError(f"state {state!r}: one of {STATES}")
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self.status.state = state
        if self.every_s > 0:
            self.tick()

    def _loop(self) -> None:
        self.tick()
        while not self._stop.wait(self.every_s):
            self.tick()

    def _change(self, apply: Callable[[RunStatus], None]) -> None:
        with self._lock:
            apply(self.status)
            s = replace(self.status)
        if self.on_change is not None:
            self.on_change(s)
