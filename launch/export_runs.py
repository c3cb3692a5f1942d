"""Copy a study's finished runs into a folder small enough to commit: each run's config and gzipped metrics.

    python -m launch.export_runs runs/study-p1 docs/study/p1

Every run folder under SRC (a folder holding ``metrics.jsonl``) whose metrics hold an ``end`` record is copied
to the same relative path under DST as ``config.yaml`` and ``metrics.jsonl.gz``; checkpoints and stored stages
stay behind. Unfinished runs are listed and skipped. The study's reports (``study.md``, ``summary.json``,
``pilot.md``, ``pilot.json``) and the untrained policy's scores (``initial/*.json``) are copied as they are. DST is
replaced, so a later export after more runs have finished gives the whole set.

    python -m launch.export_runs --restore docs/study/p1 runs/study-p1

does the inverse: each exported run whose folder under DST holds no ``metrics.jsonl`` yet gets its ``config.yaml``
and unzipped metrics back, with the untrained policy's scores, so that ``launch.study`` with the same command skips
those runs as finished (their stored stages are not exported: a replay of such a run's stage needs it run again)
and ``--report-only`` over DST recomputes the report. A run already in DST is never overwritten.
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
        packed = dst / rel / "metrics.jsonl.gz"
        with metrics.open("rb") as fin, packed.open("wb") as raw:  # mtime 0: a re-export is byte-identical
            with gzip.GzipFile(filename="metrics.jsonl", mode="wb", compresslevel=9, fileobj=raw, mtime=0) as fout:
                shutil.copyfileobj(fin, fout)
        copied.append(rel)
    for path in [*sorted(src.rglob("initial/*.json")), *(p for name in REPORTS for p in sorted(src.rglob(name)))]:
        (dst / path.parent.relative_to(src)).mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dst / path.relative_to(src))
    return copied, skipped


def restore(exported: Path, dst: Path) -> tuple[list[Path], list[Path]]:
    """Unpack the runs of an ``exported`` folder into the study folder ``dst``; returns (restored, kept) run
    folders, relative to ``exported``: kept ones already had metrics in ``dst`` and were left as they were."""
    if not exported.is_dir():
        raise FileNotFoundError(f"{exported}: no such exported folder")
    restored, kept = [], []
    for packed in sorted(exported.rglob("metrics.jsonl.gz")):
        rel = packed.parent.relative_to(exported)
        if (dst / rel / "metrics.jsonl").exists():
            kept.append(rel)
            continue
        (dst / rel).mkdir(parents=True, exist_ok=True)
        if (packed.parent / "config.yaml").is_file():
            shutil.copy2(packed.parent / "config.yaml", dst / rel / "config.yaml")
        with gzip.open(packed, "rb") as fin, (dst / rel / "metrics.jsonl").open("wb") as fout:
            shutil.copyfileobj(fin, fout)
        restored.append(rel)
    for path in sorted(exported.rglob("initial/*.json")):
        target = dst / path.relative_to(exported)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    return restored, kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.export_runs", description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="the study's --out folder (with --restore: the exported folder)")
    parser.add_argument("dst", type=Path, help="the folder to write (replaced; with --restore: the study folder)")
    parser.add_argument("--restore", action="store_true", help="unpack an exported folder into a study folder")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.restore:
            restored, kept = restore(args.src, args.dst)
            print(f"{len(restored)} runs restored into {args.dst}; {len(kept)} already there, left as they were")
            return 0
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
