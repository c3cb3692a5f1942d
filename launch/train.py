"""Train with mu-GRPO.

    python -m launch.train --config configs/tiny-cpu.yaml [--mode sync|async] [dotted.key=value ...]

Same through Ray Jobs: ``ray job submit --working-dir . -- python -m launch.train --config ...``.
A bad config, or inputs it names that are missing or unreadable (model folder, data file, benchmark
files), exit with code 2 and one message naming the key(s), before Ray or any actor starts; ``--dry-run``
prints the plan and runs the same checks, and with ``--cluster 2x8`` (or RAY_ADDRESS set) where each actor
goes. A run then checks the installed vLLM, torch, DeepSpeed, Ray and transformers
(:mod:`mugrpo_async.versions`): exit 2 naming what is installed and what is supported.
An existing run folder is continued from its newest valid checkpoint (``run.resume=auto``; ``--resume``
insists on it). A run that stops (an actor died past what the run survives, generation failed, updates
kept failing) exits with code 3 and one line naming the newest checkpoint and the command that resumes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from mugrpo_async.choices import SCHEDULE_MODES
from mugrpo_async.config import Config, ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config (defaults apply when omitted)")
    parser.add_argument("--mode", choices=SCHEDULE_MODES, help="shorthand for schedule.mode=...")
    parser.add_argument("--resume", action="store_true", help="continue the run in run.output_dir (must exist)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and check the inputs; start nothing")
    parser.add_argument(
        "--cluster",
        help="with --dry-run: where each actor goes on NxG (N nodes of G GPUs), G (one "
        "node), NxG:C (C CPUs each) or a comma list (8,4:32); default: the cluster in RAY_ADDRESS",
    )
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_intermixed_args(argv)
    overrides = list(args.overrides) + ([f"schedule.mode={args.mode}"] if args.mode else [])
    overrides += ["run.resume=must"] if args.resume else []
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.cluster is not None and not args.dry_run:
        print("error: --cluster describes a cluster for --dry-run only (a run places its actors on the live one)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.dry_run:
        return _dry_run(args.config, cfg, args.cluster)
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not _inputs_ok(cfg) or not _stack_ok():
        return 2
    from ray.exceptions import RayActorError

    from drivers.run import ResourceError
    from drivers.stops import RunStopped, brief, resume_command
    from mugrpo_async.checkpoints.store import CheckpointError, CheckpointStore
    from mugrpo_async.data.loaders import DatasetError

    try:
        return _run(cfg)
    except (ResourceError, CheckpointError, DatasetError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (RunStopped, RayActorError) as err:  # an actor's death outside the loops stops the run the same way
        if not isinstance(err, RunStopped):
            err = RunStopped(f"an actor died ({brief(err)})")
        found = CheckpointStore(cfg.run.output_dir).checkpoints()
        err.checkpoint = err.checkpoint or (found[-1] if found else None)
        args, program = _invocation(argv)
        print(f"error: {err.describe(resume_command(args, cfg.run.resume, program))}", file=sys.stderr)
        return 3


def _inputs_ok(cfg: Config) -> bool:
    """The check both paths share (model folder, data file, benchmark files); False after printing why."""
    from mugrpo_async.inputs import InputError, check_inputs

    try:
        check_inputs(cfg)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return False
    return True


def _stack_ok() -> bool:
    """vLLM, torch, DeepSpeed, Ray and transformers are the supported versions; False after printing why."""
    from mugrpo_async.versions import VersionError, check_stack

    try:
        check_stack()
    except VersionError as err:
        print(f"error: {err}", file=sys.stderr)
        return False
    return True


def _dry_run(config_path: str | None, cfg: Config, cluster: str | None) -> int:
    """Print the plan (from the config alone) and the placement on ``cluster``, then check the inputs the run
    would read."""
    from mugrpo_async.reporting.plan import build_plan, format_plan

    print(f"dry run: {config_path or 'the defaults'} is a valid config; nothing was started\n")
    print(format_plan(build_plan(cfg)))
    if not _placement_ok(cfg, cluster) or not _inputs_ok(cfg):
        return 2
    print("inputs            model folder, data file and benchmark files checked")
    return 0


def _placement_ok(cfg: Config, cluster: str | None) -> bool:
    """Print where each actor goes on the described cluster (or the live one in RAY_ADDRESS); False after printing
    why when the description is bad or the actors do not fit."""
    import os

    from mugrpo_async.placement import PlacementError, parse_cluster, plan_placement
    from mugrpo_async.reporting.plan import format_placement

    if cluster is None and not os.environ.get("RAY_ADDRESS"):
        print("placement         pass --cluster NxG (or set RAY_ADDRESS) to see the bundle and node of each actor")
        return True
    try:
        nodes = parse_cluster(cluster) if cluster is not None else _live_nodes()
    except (ValueError, ConnectionError) as err:
        print(f"error: {'--cluster' if cluster is not None else 'RAY_ADDRESS'}: {err}", file=sys.stderr)
        return False
    try:
        placement = plan_placement(cfg, nodes)
    except PlacementError as err:
        print(f"error: {err}", file=sys.stderr)
        return False
    print(format_placement(placement, cfg))
    return True


def _live_nodes() -> tuple:
    """The nodes of the cluster in RAY_ADDRESS (connects as a client and disconnects)."""
    import ray

    from drivers.cluster import live_nodes

    ray.init(logging_level=logging.ERROR, log_to_driver=False)
    try:
        return live_nodes()
    finally:
        ray.shutdown()


def _invocation(argv: list[str] | None) -> tuple[list[str], list[str] | None]:
    """(arguments, how the program was started): as typed on the command line when ``argv`` is None."""
    if argv is not None:
        return list(argv), None
    args = sys.argv[1:]
    started = getattr(sys, "orig_argv", [])  # the interpreter, its options and ``-m launch.train``
    return args, started[: len(started) - len(args)] if len(started) > len(args) else None


def _run(cfg: Config) -> int:
    if cfg.schedule.mode == "async":
        from drivers.asynchronous import run_async

        s = run_async(cfg)
        print(f"reward (first -> last quarter of updates): {s['reward_first_quarter']:.3f} -> "
              f"{s['reward_last_quarter']:.3f}")  # fmt: skip
        print(
            f"trainer_idle_ratio {s['trainer_idle_ratio']:.3f}  T_total {s['T_total']:.1f}s  groups generated "
            f"{s['generated']} = served {s['served']} + dropped {s['dropped']} + filtered {s['groups_filtered']} + "
            f"queued {s['left_in_queue']}"
        )
        print(f"grants cut short: by the lag cap {s['blocked_lag']}, by the queue bound {s['blocked_room']}; "
              f"engine occupancy {s['engine_occupancy']:.3f}")  # fmt: skip
    else:
        from drivers.sync import run_sync

        s = run_sync(cfg)
        print("reward per stage: " + " -> ".join(f"{r:.3f}" for r in s["reward_per_stage"]))
        print(f"T_rollout {s['T_rollout']:.1f}s  T_train {s['T_train']:.1f}s  T_total {s['T_total']:.1f}s")
    print(json.dumps(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
