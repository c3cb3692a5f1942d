"""Train with mu-GRPO.

    python -m launch.train --config configs/tiny-cpu.yaml [--mode sync|async] [dotted.key=value ...]

Same through Ray Jobs: ``ray job submit --working-dir . -- python -m launch.train --config ...``.
A bad config exits with code 2 and one message naming the key(s), before any actor starts.
An existing run folder is continued from its newest valid checkpoint (``run.resume=auto``; ``--resume``
insists on it). A run stopped by a dead trainer rank or failed rollout exits with code 3 and says how
to resume.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from mugrpo_async.config import Config, ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config (defaults apply when omitted)")
    parser.add_argument("--mode", choices=["sync", "async"], help="shorthand for schedule.mode=...")
    parser.add_argument("--resume", action="store_true", help="continue the run in run.output_dir (must exist)")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the resolved plan; start nothing")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_intermixed_args(argv)
    overrides = list(args.overrides) + ([f"schedule.mode={args.mode}"] if args.mode else [])
    overrides += ["run.resume=must"] if args.resume else []
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        from mugrpo_async.reporting.plan import build_plan, format_plan

        print(f"dry run: {args.config or 'the defaults'} is a valid config; nothing was started\n")
        print(format_plan(build_plan(cfg)))
        return 0
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from mugrpo_async.checkpoints.model_folder import ModelFolderError, check_model_folder

    try:
        check_model_folder(cfg.model.path, cfg.model.trust_remote_code)
    except ModelFolderError as err:
        print(f"error: {err} (for the tiny default, run `python -m launch.prepare` first)", file=sys.stderr)
        return 2
    from drivers.rollout_pool import RolloutFailed
    from drivers.run import ResourceError, TrainerFailed
    from mugrpo_async.checkpoints.store import CheckpointError
    from mugrpo_async.data.loaders import DatasetError

    try:
        return _run(cfg)
    except (ResourceError, CheckpointError, DatasetError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (TrainerFailed, RolloutFailed) as err:
        print(f"error: the run stopped: {err}", file=sys.stderr)
        return 3


def _run(cfg: Config) -> int:
    if cfg.schedule.mode == "async":
        from drivers.asynchronous import run_async

        s = run_async(cfg)
        print(f"reward (first -> last quarter of updates): {s['reward_first_quarter']:.3f} -> "
              f"{s['reward_last_quarter']:.3f}")  # fmt: skip
        print(
            f"trainer_idle_ratio {s['trainer_idle_ratio']:.3f}  T_total {s['T_total']:.1f}s  groups generated "
            f"{s['generated']} = served {s['served']} + dropped {s['dropped']} + queued {s['left_in_queue']}"
        )
    else:
        from drivers.sync import run_sync

        s = run_sync(cfg)
        print("reward per stage: " + " -> ".join(f"{r:.3f}" for r in s["reward_per_stage"]))
        print(f"T_rollout {s['T_rollout']:.1f}s  T_train {s['T_train']:.1f}s  T_total {s['T_total']:.1f}s")
    print(json.dumps(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
