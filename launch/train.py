"""Train with mu-GRPO.

    python -m launch.train --config configs/tiny-cpu.yaml [--mode sync|async] [dotted.key=value ...]

Same through Ray Jobs: ``ray job submit --working-dir . -- python -m launch.train --config ...``.
A bad config exits with code 2 and one message naming the key(s), before any actor starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from mugrpo_async.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config (defaults apply when omitted)")
    parser.add_argument("--mode", choices=["sync", "async"], help="shorthand for schedule.mode=...")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    overrides = list(args.overrides) + ([f"schedule.mode={args.mode}"] if args.mode else [])
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from mugrpo_async.checkpoint import ModelFolderError, check_model_folder

    try:
        check_model_folder(cfg.model.path, cfg.model.trust_remote_code)
    except ModelFolderError as err:
        print(f"error: {err} (for the tiny default, run `python -m launch.prepare` first)", file=sys.stderr)
        return 2
    if cfg.schedule.mode == "async":
        print("error: schedule.mode=async is not available yet; use sync", file=sys.stderr)
        return 2
    from launch.pipeline import run_sync

    summary = run_sync(cfg)
    rewards = " -> ".join(f"{r:.3f}" for r in summary["reward_per_stage"])
    print(f"reward per stage: {rewards}")
    s = summary
    print(f"T_rollout {s['T_rollout']:.1f}s  T_train {s['T_train']:.1f}s  T_total {s['T_total']:.1f}s")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
