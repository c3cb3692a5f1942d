"""Shared fixtures: the tiny model folder and a local Ray cluster (integration tier only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / ".cache" / "models" / "tiny-arith"

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The default tiny model (built once by `make model`; built here if missing)."""
    from mugrpo_async.models.tiny import ensure_tiny_model

    if os.environ.get("MUGRPO_TEST_MODEL"):  # a prebuilt folder, e.g. while developing the warm start
        return Path(os.environ["MUGRPO_TEST_MODEL"])
    return ensure_tiny_model(TINY_MODEL)


@pytest.fixture(scope="session")
def tiny_steps_model() -> Path:
    """The multi-step task's tiny model (built once by `python -m launch.prepare --model tiny-steps`; here if
    missing or stale)."""
    from mugrpo_async.models.tiny_steps import ensure_steps_model

    return ensure_steps_model(REPO / ".cache" / "models" / "tiny-steps")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster for the whole session (no dashboard: tests do not need it)."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def tiny_config(model_path: Path, output_dir: Path | None = None, overrides: list[str] | None = None):
    """A small config over the tiny model, for integration tests."""
    from mugrpo_async.config import load_config

    base = [
        f"model.path={model_path}",
        f"run.output_dir={output_dir or '/tmp/unused'}",
        "run.dashboard=false",
        "logging.progress=false",
        "logging.tensorboard=true",
        "schedule.total_updates=4",
        "schedule.mu=2",
        "schedule.groups_per_update=4",
    ]
    return load_config(REPO / "configs" / "tiny-cpu.yaml", base + (overrides or []))
