"""Copy a study's finished runs into a folder small enough to commit: each run's config and gzipped metrics.

    python -m launch.export_runs runs/study-p1 docs/study/p1

Every run folder under SRC (a folder holding ``metrics.jsonl``) whose metrics hold an ``end`` record is copied
to the same relative path under DST as ``config.yaml`` and ``metrics.jsonl.gz``; checkpoints and stored stages
stay behind. Unfinished runs are listed and skipped. The study's reports (``study.md``, ``summary.json``,
``pilot.md``, ``pilot.json``) and the untrained policy's scores (``initial/*.json``) are copied as they are. DST is
replaced, so a later export after more runs have finished gives the whole set. To recompute a report from DST:
copy it, ``gunzip`` each ``metrics.jsonl.gz``, and run ``launch.study`` (or ``launch.pilot``) with
``--report-only`` and ``--out`` at the copy.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
from pathlib import Path

from mugrpo_async.reporting.study import read_run_records

REPORTS = ("study.md", "summary.json", "pilot.md", "pilot.json")


def finished(metrics: Path) -> bool:
    """Whether a run's metrics hold its ``end`` record (a stopped or running run's do not)."""
    return any(r.get("kind") == "end" for r in read_run_records(metrics.parent))


def export(src: Path, dst: Path) -> tuple[list[Path], list[Path]]:
    """Copy the finished runs and the reports of ``src`` into a fresh ``dst``; returns (copied, skipped) run
    folders, relative to ``src``."""
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such study folder")
    if dst.exists():
        shutil.rmtree(dst)
    copied, skipped = [], []
    for metrics in sorted(src.rglob("metrics.jsonl")):
        rel = metrics.parent.relative_to(src)
        if "checkpoints" in rel.parts:
            continue
        if not finished(metrics):
            skipped.append(rel)
            continue
        (dst / rel).mkdir(parents=True, exist_ok=True)
        if (metrics.parent / "config.yaml").is_file():
            shutil.copy2(metrics.parent / "config.yaml", dst / rel / "config.yaml")
        with metrics.open("rb") as fin, gzip.open(dst / rel / "metrics.jsonl.gz", "wb", compresslevel=9) as fout:
            shutil.copyfileobj(fin, fout)
        copied.append(rel)
    for path in [*sorted(src.rglob("initial/*.json")), *(p for name in REPORTS for p in sorted(src.rglob(name)))]:
        (dst / path.parent.relative_to(src)).mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dst / path.relative_to(src))
    return copied, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.export_runs", description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="the study's --out folder")
    parser.add_argument("dst", type=Path, help="the folder to write (replaced)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        copied, skipped = export(args.src, args.dst)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for rel in skipped:
        print(f"skipped (not finished): {rel}")
    size = sum(p.stat().st_size for p in args.dst.rglob("*") if p.is_file()) if args.dst.exists() else 0
    print(f"{len(copied)} finished runs copied to {args.dst} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
