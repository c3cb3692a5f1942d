"""A local Ray cluster in the benchmark's own process, and the project's actors started in it.

Benchmarks 2, 3 and 5 drive the real actors (``RolloutWorker``, ``TrainerRank``) directly instead of
through the training CLI, to time one operation at a time.

    .venv/bin/python -m bench.run --only 2,3,5
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from bench.common import REPO, run_env

_STARTED = False
# Smoke runs (``bench.run --smoke``) hand an actor that a later benchmark starts alike on to it instead of killing
# and restarting it (benchmark 2's rollout worker to benchmark 3, benchmark 3's trainer rank to benchmark 5): each
# start costs seconds of a smoke run that only checks the code paths. Measured runs always start fresh actors.
SHARE = False
_IDLE: dict[tuple[str, str], object] = {}  # (kind, config as JSON) -> an actor handed on by release(keep=True)


def _key(kind: str, cfg) -> tuple[str, str]:
    return kind, json.dumps(cfg.to_dict(), sort_keys=True, default=str)


def release(kind: str, cfg, actor, keep: bool = False) -> None:
    """Done with ``actor`` (a ``kind`` = "rollout" or "trainer" actor started on ``cfg``): kill it, or, in a smoke run
    and with ``keep``, leave it to the next benchmark that starts one alike.

    A kept actor holds its CPU reservation: keep only one that a later benchmark of the run starts again.
    """
    import ray

    if SHARE and keep:
        _IDLE[_key(kind, cfg)] = actor
    else:
        ray.kill(actor)


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    """A local Ray cluster (no dashboard) for the block: started on first use, shut down at exit.

    Benchmarks 2, 3 and 5 share it; each kills the actors it started, so the next finds the cluster idle.
    """
    import atexit

    import ray

    global _STARTED
    if not _STARTED:
        for key, value in run_env().items():
            os.environ.setdefault(key, value)
        env = {"env_vars": {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}}
        ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False,
                 log_to_driver=False, runtime_env=env)  # fmt: skip
        atexit.register(ray.shutdown)
        _STARTED = True
    yield


def tiny_config(overrides: list[str] | None = None, model: str | Path | None = None):
    """The tiny config (``configs/tiny-cpu.yaml``) with an absolute model path and ``overrides``."""
    from mugrpo_async.config import load_config

    path = Path(model) if model else REPO / ".cache" / "models" / "tiny-arith"
    base = [f"model.path={path.resolve()}", "run.dashboard=false", "logging.progress=false"]
    return load_config(REPO / "configs" / "tiny-cpu.yaml", base + (overrides or []))


def rollout_worker(cfg, index: int = 0):
    """A RolloutWorker actor, started as the training run starts it (engine env, one CPU), or the one handed on."""
    from actors.rollout import RolloutWorker, engine_env

    if (kept := _IDLE.pop(_key("rollout", cfg), None)) is not None:
        return kept
    return RolloutWorker.options(
        num_cpus=cfg.rollout.cpus_per_worker, runtime_env={"env_vars": engine_env(cfg)}
    ).remote(cfg.to_dict(), index)


def trainer_rank(cfg):
    """A one-rank TrainerRank actor, started (and set up: model, optimizer, engine) as the training run starts it, or
    the one handed on."""
    from drivers.trainer_group import start_trainer_group

    if (kept := _IDLE.pop(_key("trainer", cfg), None)) is not None:
        return kept
    options = {"num_cpus": cfg.trainer.cpus_per_rank, "num_gpus": cfg.trainer.gpus_per_rank}
    (rank,) = start_trainer_group(cfg, [options])
    return rank


def prompts(cfg) -> list[dict]:
    """The run's prompt pool (tokenised synthetic problems)."""
    from transformers import AutoTokenizer

    from mugrpo_async.data.pool import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    return load_prompts(cfg, tokenizer)[0]
