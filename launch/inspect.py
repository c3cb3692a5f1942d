"""Summarise rollout datasets on disk (checksums verified).

    python -m launch.inspect runs/tiny-cpu                      # every stage of a run folder
    python -m launch.inspect runs/tiny-cpu/rollouts/stage-0     # one stage (or rollouts/async)

Prints, per stage: groups, responses, response tokens, reward mean, response lengths, finish reasons,
policy versions and whether the stage is complete. A corrupt shard is named and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mugrpo_async.rollout.samples import SampleError
from mugrpo_async.rollout.shards import MANIFEST, read_stage, summarize


def stage_dirs(folder: Path) -> list[Path]:
    if (folder / MANIFEST).is_file():
        return [folder]
    root = folder / "rollouts" if (folder / "rollouts").is_dir() else folder
    return sorted((p.parent for p in root.glob(f"*/{MANIFEST}")), key=lambda p: (len(p.name), p.name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.inspect", description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="run folder, rollouts/ folder, or one stage folder")
    parser.add_argument("--json", action="store_true", help="one JSON object per stage instead of a table")
    args = parser.parse_args(argv)
    dirs = stage_dirs(args.folder)
    if not dirs:
        print(f"error: no rollout datasets ({MANIFEST}) under {args.folder}", file=sys.stderr)
        return 2
    bad = 0
    if not args.json:
        print(f"{'stage':<10}{'groups':>8}{'resp':>7}{'tokens':>9}{'reward':>8}{'len':>7}{'min':>5}{'max':>5}"
              f"  {'complete':<9}versions / finish reasons")  # fmt: skip
    for d in dirs:
        try:
            manifest, groups = read_stage(d)
        except SampleError as err:
            print(f"{d.name:<10}corrupt: {err}")
            bad += 1
            continue
        s = {"stage": d.name, "complete": manifest.get("complete", False), **summarize(groups)}
        if args.json:
            print(json.dumps(s))
            continue
        print(f"{d.name:<10}{s['groups']:>8}{s['responses']:>7}{s['response_tokens']:>9}{s['reward_mean']:>8.3f}"
              f"{s['response_len_mean']:>7.1f}{s['response_len_min']:>5}{s['response_len_max']:>5}  "
              f"{str(s['complete']):<9}{s['policy_versions']} {s['finish_reasons']}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
