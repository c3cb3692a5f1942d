"""Live status of a run in the terminal, refreshed in place until the run ends.

    python -m launch.watch runs/tiny-cpu            # live; exits 0 when the run finished, 3 when it stopped
    python -m launch.watch runs/tiny-cpu --once     # one snapshot

Reads the run folder's ``status.json`` (written by the driver every ``logging.status_every_s`` seconds; the same
line the job log shows) or, without one, ``metrics.jsonl`` (:func:`mugrpo_async.reporting.status.load_status`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

from mugrpo_async.reporting.status import RunStatus, format_duration, format_status, load_status

EXIT = {"finished": 0, "stopped": 3}


def describe(s: RunStatus | None, folder: Path, now: float) -> list[str]:
    """The lines shown for one refresh: the status line and how fresh it is."""
    if s is None:
        return [f"{folder}: no status.json or metrics.jsonl yet (waiting for the run)"]
    lines = [format_status(s)]
    if s.state == "running" and s.written_at:
        age = now - s.written_at
        note = f"written {format_duration(age)} ago"
        if s.every_s and age > 3 * s.every_s + 30:
            note += " (no news since: is the driver still running?)"
        lines.append(note)
    return lines


def redraw(lines: list[str], previous: int) -> str:
    """ANSI text that replaces the ``previous`` lines last drawn with ``lines``."""
    up = f"\x1b[{previous}F" if previous else ""
    return up + "\x1b[J" + "".join(f"{line}\n" for line in lines)


def watch(folder: Path, every_s: float, out: TextIO, max_wait_s: float | None = None) -> int:
    """Refresh until the run ends; returns :data:`EXIT` of its state (1 when ``max_wait_s`` ran out first).

    On a terminal the lines are redrawn in place; otherwise (a pipe, a log) a line is printed when it changes.
    """
    tty, drawn, last = out.isatty(), 0, None
    deadline = None if max_wait_s is None else time.monotonic() + max_wait_s
    while True:
        s = load_status(folder)
        lines = describe(s, folder, time.time())
        if tty:
            out.write(redraw(lines, drawn))
            drawn = len(lines)
        elif lines[0] != last:
            out.write(lines[0] + "\n")
        last = lines[0]
        out.flush()
        if s is not None and s.state in EXIT:
            return EXIT[s.state]
        if deadline is not None and time.monotonic() > deadline:
            return 1
        time.sleep(every_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.watch", description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="the run folder (run.output_dir)")
    ap.add_argument("--once", action="store_true", help="print one snapshot and exit")
    ap.add_argument("--every", type=float, default=2.0, help="seconds between refreshes (default 2)")
    args = ap.parse_args(argv)
    if args.every <= 0:
        ap.error("--every: must be > 0")
    if args.once:
        s = load_status(args.folder)
        print("\n".join(describe(s, args.folder, time.time())))
        return 1 if s is None else 0
    try:
        return watch(args.folder, args.every, sys.stdout)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
