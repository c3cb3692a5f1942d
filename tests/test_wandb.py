"""Weights & Biases as an optional logger beside TensorBoard: offline mode with no network, the settings a config
asks for, and the clear error when it is enabled but the package is missing (no Ray)."""

from __future__ import annotations

import importlib.util

import pytest

from mugrpo_async.config import ConfigError, load_config
from mugrpo_async.reporting.metrics import MetricsSink, wandb_settings

HAVE_WANDB = importlib.util.find_spec("wandb") is not None


def test_settings_default_off_and_offline_without_a_key(monkeypatch):
    assert wandb_settings(load_config(None, [])) is None
    if not HAVE_WANDB:
        pytest.skip("wandb is not installed (pip install -e '.[wandb]'): a config with logging.wandb=true is refused")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config(None, ["logging.wandb=true", "run.name=r1", "logging.wandb_project=p"])
    s = wandb_settings(cfg)
    assert (s["project"], s["name"], s["mode"]) == ("p", "r1", "offline") and s["config"]["run"]["name"] == "r1"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_settings(cfg)["mode"] == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the environment wins
    assert wandb_settings(cfg)["mode"] == "disabled"


def test_enabled_without_the_package_is_a_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="logging.wandb: the wandb package is not installed"):
        load_config(None, ["logging.wandb=true"])


@pytest.mark.skipif(not HAVE_WANDB, reason="wandb is not installed (pip install -e '.[wandb]')")
def test_offline_run_writes_its_run_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["logging.wandb=true", f"run.output_dir={tmp_path}"])
    sink = MetricsSink(tmp_path, tensorboard=False, wandb=wandb_settings(cfg))
    sink.write({"kind": "update", "update": 1, "loss": 0.25, "lr": 1e-6, "note": "text is left out"})
    sink.write({"kind": "stage", "stage": 0, "reward_mean": 0.5})
    sink.close()
    run_id = (tmp_path / "wandb" / "run-id").read_text()
    (run_dir,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
    assert list(run_dir.glob("*.wandb"))  # the offline run's records, for `wandb sync` later
    # a resumed run folder continues the same run
    MetricsSink(tmp_path, tensorboard=False, wandb=wandb_settings(cfg)).close()
    assert (tmp_path / "wandb" / "run-id").read_text() == run_id
