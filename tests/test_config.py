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
        (["algo.clip_low=2", "algo.clip_high=1"], "algo.clip_low"),
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
    assert out.stderr == "error: invalid config: trainer.lrr: unknown key\n"


def test_config_imports_without_torch_or_ray():
    code = "import sys, mugrpo_async.config; assert 'torch' not in sys.modules and 'ray' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_shipped_configs_load_and_base_chains(tmp_path):
    from tests.conftest import REPO

    for path in sorted((REPO / "configs").rglob("*.yaml")):  # configs/study/ too
        load_config(path)
    a = load_config(REPO / "configs" / "tiny-cpu-async-grpo.yaml")
    assert a.schedule.mode == "async" and a.schedule.mu == 4 and a.algo.name == "grpo" and a.algo.clip_high == 1.2
    assert a.trainer.lr == load_config(REPO / "configs" / "tiny-cpu.yaml").trainer.lr  # from the base chain
    m = load_config(REPO / "configs" / "tiny-cpu-async.yaml")
    assert (m.schedule.mu, m.schedule.sync_every, m.algo.name) == (1024, 4, "mu_grpo")
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "loop.yaml")


# ---- values that parse but that a later stage of the run would refuse -------------------------------------


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    return str(err.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        # the loss: 0 <= clip_low <= 1 <= clip_high (LossSpec)
        (["algo.clip_low=1.5"], "algo.clip_low: Input should be less than or equal to 1"),
        (["algo.clip_low=-0.1"], "algo.clip_low: Input should be greater than or equal to 0"),
        (["algo.clip_high=0.9"], "algo.clip_high: Input should be greater than or equal to 1"),
        (["algo.clip_high=.nan"], "algo.clip_high: Input should be greater than or equal to 1"),
        (["algo.dual_clip_c=1"], "algo.dual_clip_c: Input should be greater than 1"),
        (["algo.dual_clip_c=.inf"], "algo.dual_clip_c: Input should be a finite number"),
        (["algo.nav_tau=0"], "algo.nav_tau: Input should be greater than 0"),
        (["algo.m2po_threshold=.nan"], "algo.m2po_threshold: Input should be a finite number"),
        (["algo.kl_coef=.inf"], "algo.kl_coef: Input should be a finite number"),
        (["algo.tis_cap=0.5"], "algo.tis_cap: Input should be greater than or equal to 1"),
        (["algo.tis_cap=.inf"], "algo.tis_cap: Input should be a finite number"),
        # the trainer: AdamW and DeepSpeed
        (["trainer.lr=inf"], "trainer.lr: Input should be a finite number"),
        (["trainer.lr=.nan"], "trainer.lr: Input should be a finite number"),
        (["trainer.betas=[1.0, 0.999]"], "trainer.betas.0: Input should be less than 1"),
        (["trainer.betas=[0.9, -0.1]"], "trainer.betas.1: Input should be greater than or equal to 0"),
        (["trainer.betas=[0.9]"], "trainer.betas: List should have at least 2 items after validation, not 1"),
        (["trainer.weight_decay=.inf"], "trainer.weight_decay: Input should be a finite number"),
        (["trainer.grad_clip=.nan"], "trainer.grad_clip: Input should be a finite number"),
        (["rollout.temperature=.inf"], "rollout.temperature: Input should be a finite number"),
        (["reward.timeout_s=.nan"], "reward.timeout_s: Input should be a finite number"),
        (["schedule.get_timeout_s=inf"], "schedule.get_timeout_s: Input should be a finite number"),
        (["eval.temperature=.inf"], "eval.temperature: Input should be a finite number"),
        (["eval.ks=[1, 0]"], "eval.ks.1: Input should be greater than or equal to 1"),
    ],
)
def test_field_bounds_name_the_key(overrides, message):
    assert _error(overrides) == f"invalid config: {message}"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["schedule.total_updates=10", "schedule.mu=4"],
         "schedule.total_updates: must be a multiple of schedule.mu (4) in sync mode (stages of mu updates), got 10"),
        (["schedule.mode=async", "schedule.groups_per_update=8", "schedule.queue_max_groups=4"],
         "schedule.queue_max_groups: must hold one minibatch (schedule.groups_per_update = 8) or be 0, got 4"),
        (["schedule.mode=async", "schedule.mu=4", "schedule.sync_every=8"],
         "schedule.sync_every: must be <= schedule.mu (4) in async mode (groups of the newest published weights "
         "must stay within the lag cap until the next publish), got 8"),
        (["trainer.num_ranks=3"],
         "trainer.num_ranks: must divide schedule.groups_per_update x rollout.group_size (256 responses per "
         "update), got 3"),
        (["model.dtype=float16"],
         "model.dtype: float16 needs GPU trainer ranks (trainer.gpus_per_rank > 0): DeepSpeed's CPU accelerator "
         "refuses fp16: use bfloat16 or float32"),
        (["rollout.gpus_per_worker=0.00005"],
         "rollout.gpus_per_worker: below Ray's resource precision 0.0001 (use 0 or at least that), got 5e-05"),
        (["trainer.cpus_per_rank=0.00001"],
         "trainer.cpus_per_rank: below Ray's resource precision 0.0001 (use 0 or at least that), got 1e-05"),
        (["schedule.mode=async", "schedule.mu=8", "algo.tis_cap=2"],
         "algo.tis_cap: sync mode only, since the async trainer no longer holds the behaviour weights of a group "
         "served with lag > 0 (unset it, or use schedule.mode sync)"),
        (["data.source=file"], "data.path: required when data.source is `file`"),
        (["data.template=chat"],
         "data.template: `chat` needs data.source `file` (the synthetic task uses its own prompt: template `auto` "
         "or `none`)"),
        (["data.source=file", "data.path=x.jsonl", "data.format=custom", "data.problem_key=q"],
         "data.answer_key: required when data.format is `custom`"),
        (["data.levels=[0, 2, 5]"], "data.levels: the synthetic task has levels [1, 2, 3, 4], got [0, 5]"),
        (["eval.temperature=0", "eval.n_samples=4"],
         "eval.n_samples: greedy evaluation (eval.temperature 0) samples once per problem: use 0 or 1, got 4"),
        (["eval.benchmarks=[heldout]", "data.source=file", "data.path=x.jsonl"],
         "eval.benchmarks: `heldout` evaluates the rows held out of data.path, so data.heldout_problems must be >= 1"),
        (["eval.benchmarks=[heldout]", "eval.num_problems=0"],
         "eval.num_problems: `heldout` of the synthetic task evaluates this many problems, so it must be >= 1"),
    ],
)  # fmt: skip
def test_rules_across_keys_name_the_key(overrides, message):
    assert _error(overrides) == f"invalid config: {message}"


def test_every_problem_is_reported_at_once():
    err = _error(["schedule.mode=async", "schedule.mu=4", "schedule.sync_every=8", "algo.tis_cap=2",
                  "eval.temperature=0", "eval.n_samples=2"])  # fmt: skip
    keys = [part.split(":")[0] for part in err.removeprefix("invalid config: ").split("; ")]
    assert keys == ["schedule.sync_every", "algo.tis_cap", "eval.n_samples"]


def test_the_allowed_side_of_each_rule_loads():
    cfg = load_config(None, ["algo.clip_low=1", "algo.clip_high=1", "trainer.betas=[0.0, 0.999999]"])
    assert (cfg.algo.clip_low, cfg.algo.clip_high, cfg.trainer.betas) == (1.0, 1.0, [0.0, 0.999999])
    assert math.isinf(load_config(None, ["algo.clip_high=.inf"]).algo.clip_high)
    assert load_config(None, ["algo.tis_cap=2"]).algo.tis_cap == 2.0  # sync mode
    assert load_config(None, ["schedule.mode=async", "schedule.mu=4", "schedule.sync_every=4"]).schedule.sync_every == 4
    assert load_config(None, ["schedule.mu=4", "schedule.sync_every=8"]).schedule.sync_every == 8  # sync: unused
    assert load_config(None, ["model.dtype=float16", "trainer.gpus_per_rank=1"]).model.dtype == "float16"
    for n in (0, 1):
        assert load_config(None, ["eval.temperature=0", f"eval.n_samples={n}"]).eval.n_samples == n
    assert load_config(None, ["rollout.gpus_per_worker=0.0001", "trainer.gpus_per_rank=0"]).rollout.gpus_per_worker
    heldout = ["eval.benchmarks=[heldout]", "data.source=file", "data.path=x.jsonl", "data.heldout_problems=10"]
    assert load_config(None, heldout).eval.benchmarks == ["heldout"]


@pytest.mark.parametrize("name", sorted(ALGO_PRESETS))
def test_the_loss_accepts_every_config_the_schema_accepts(name):
    """LossSpec (what the trainer builds) agrees with the schema at every bound the schema allows."""
    from mugrpo_async.algo.loss import LossSpec

    edges = [[], ["algo.clip_low=0", "algo.clip_high=1"], ["algo.clip_low=1", "algo.clip_high=.inf"],
             ["algo.nav_tau=0.999", "algo.dual_clip_c=1.0001", "algo.m2po_threshold=1e-9", "algo.kl_coef=0",
              "algo.tis_cap=1"], ["algo.nav_scope=suffix", "algo.loss_agg=token_mean", "algo.kl_coef=1e3"]]  # fmt: skip
    for extra in edges:
        cfg = load_config(None, [f"algo.name={name}", *extra])
        assert LossSpec.from_config(cfg.algo).clip_high == cfg.algo.clip_high


@pytest.mark.parametrize("betas", [[0.0, 0.0], [0.9, 0.999], [0.999999, 0.5]])
def test_adamw_accepts_the_betas_the_schema_accepts(betas):
    import torch

    cfg = load_config(None, [f"trainer.betas={betas}"])
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=cfg.trainer.lr, betas=tuple(cfg.trainer.betas))
    for bad in ([1.0, 0.5], [0.5, 1.0], [-0.1, 0.5]):
        with pytest.raises(ValueError, match="Invalid beta"):
            torch.optim.AdamW([torch.zeros(1, requires_grad=True)], betas=tuple(bad))
        with pytest.raises(ConfigError, match="trainer.betas"):
            load_config(None, [f"trainer.betas={bad}"])


def test_synthetic_levels_agree_with_the_task():
    from mugrpo_async.data.task import generate_problems

    cfg = load_config(None, ["data.levels=[4, 1]"])
    assert {p.level for p in generate_problems(8, seed=0, levels=cfg.data.levels)} == {1, 4}
    with pytest.raises(ValueError, match="levels must be a non-empty subset"):
        generate_problems(1, seed=0, levels=[5])


@pytest.mark.parametrize(
    "overrides",
    [
        ["algo.clip_low=1.5"],
        ["trainer.lr=inf"],
        ["eval.temperature=0", "eval.n_samples=4"],
        ["--mode", "async", "algo.tis_cap=2"],
        ["trainer.betas=[0.9, 1.0]", "schedule.total_updates=100"],
    ],
)
def test_cli_run_and_dry_run_give_the_same_line_and_exit_2(overrides):
    def cli(*extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "launch.train", "--config", "configs/tiny-cpu.yaml", *overrides, *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    run, dry = cli(), cli("--dry-run")
    assert run.returncode == dry.returncode == 2
    assert run.stderr == dry.stderr and run.stderr.startswith("error: invalid config: ")
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert run.stdout == dry.stdout == ""  # the dry run prints no plan for an invalid config


def test_a_key_at_its_default_stays_out_of_the_resume_digest():
    """A key added later with a default that keeps the old behaviour must not stop older run folders resuming."""
    base = load_config(None, [])
    explicit_default = load_config(None, [f"algo.clip_high={base.algo.clip_high}"])
    assert explicit_default.resume_digest() == base.resume_digest()
    assert load_config(None, ["algo.clip_high=4.0"]).resume_digest() != base.resume_digest()
