"""The config tree: defaults, presets, overrides and the errors users see."""

import math
import subprocess
import sys

import pytest

from mugrpo_async.config import ALGO_PRESETS, ConfigError, load_config, parse_overrides, save_config


def test_defaults_are_the_paper_settings():
    cfg = load_config(None)
    assert cfg.algo.name == "mu_grpo"
    assert (cfg.algo.clip_low, cfg.algo.clip_high, cfg.algo.nav_scope, cfg.algo.nav_tau) == (0.0, 5.0, "sequence", 1e-4)
    assert cfg.algo.loss_agg == "seq_mean_token_mean"
    assert (cfg.schedule.mu, cfg.schedule.sync_every, cfg.schedule.groups_per_update) == (1024, 4, 32)
    assert cfg.schedule.num_stages == 4 and cfg.schedule.groups_per_stage == 1024 * 32
    assert cfg.trainer.lr == 1e-6 and cfg.trainer.weight_decay == 0.01 and cfg.trainer.zero_stage == 2
    assert cfg.rollout.group_size == 8 and cfg.rollout.temperature == 1.0


@pytest.mark.parametrize("name", sorted(ALGO_PRESETS))
def test_presets_apply_and_fields_override(name):
    cfg = load_config(None, [f"algo.name={name}"])
    for key, value in ALGO_PRESETS[name].items():
        assert getattr(cfg.algo, key) == value
    cfg = load_config(None, [f"algo.name={name}", "algo.nav_tau=0.01", "algo.clip_high=.inf", "algo.clip_low=0.5"])
    assert cfg.algo.nav_tau == 0.01 and math.isinf(cfg.algo.clip_high) and cfg.algo.clip_low == 0.5


def test_grpo_preset_is_standard_clipping():
    cfg = load_config(None, ["algo.name=grpo"])
    assert (cfg.algo.clip_low, cfg.algo.clip_high, cfg.algo.nav_scope) == (0.8, 1.2, "none")
    assert load_config(None, ["algo.name=m2po"]).algo.m2po_threshold == 0.04


@pytest.mark.parametrize(
    "override, key",
    [
        (["trainer.lrr=1"], "trainer.lrr"),
        (["algo.name=ppo"], "algo.name"),
        (["algo.nav_scope=prefix"], "algo.nav_scope"),
        (["rollout.group_size=1"], "rollout.group_size"),
        (["schedule.total_updates=10", "schedule.mu=4"], "schedule.total_updates"),
        (["trainer.num_ranks=3"], "trainer.num_ranks"),
        (["algo.clip_low=2", "algo.clip_high=1"], "clip_low"),
        (["nosuch.section=1"], "nosuch"),
    ],
)
def test_errors_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert key in str(err.value)


def test_override_syntax_and_yaml_roundtrip(tmp_path):
    assert parse_overrides(["a.b=1", "a.c=x", "d=[1, 2]"]) == {"a": {"b": 1, "c": "x"}, "d": [1, 2]}
    with pytest.raises(ConfigError):
        parse_overrides(["novalue"])
    cfg = load_config(None, ["algo.name=m2po", "schedule.mu=8", "schedule.total_updates=16"])
    save_config(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert again == cfg and again.digest() == cfg.digest()
    assert load_config(None).digest() != cfg.digest()


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")


def test_derived_micro_batches():
    cfg = load_config(None, ["schedule.groups_per_update=4", "trainer.num_ranks=2", "trainer.micro_batch_size=5"])
    assert cfg.responses_per_rank == 16 and cfg.micro_batches_per_rank == 4


def test_cli_bad_config_exits_2_without_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config", "configs/tiny-cpu.yaml", "trainer.lrr=3"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "trainer.lrr" in out.stderr and "Traceback" not in out.stderr


def test_config_imports_without_torch_or_ray():
    code = "import sys, mugrpo_async.config; assert 'torch' not in sys.modules and 'ray' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_shipped_configs_load_and_base_chains(tmp_path):
    from tests.conftest import REPO

    for path in sorted((REPO / "configs").glob("*.yaml")):
        load_config(path)
    a = load_config(REPO / "configs" / "tiny-cpu-async-grpo.yaml")
    assert a.schedule.mode == "async" and a.schedule.mu == 4 and a.algo.name == "grpo" and a.algo.clip_high == 1.2
    assert a.trainer.lr == load_config(REPO / "configs" / "tiny-cpu.yaml").trainer.lr  # from the base chain
    m = load_config(REPO / "configs" / "tiny-cpu-async.yaml")
    assert (m.schedule.mu, m.schedule.sync_every, m.algo.name) == (1024, 4, "mu_grpo")
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "loop.yaml")
