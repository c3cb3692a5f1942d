"""Each enumeration is listed once (mugrpo_async.choices) and every table of behaviour per name covers it exactly."""

from __future__ import annotations

import typing

import pytest

from mugrpo_async import choices
from mugrpo_async.config import Config, ConfigError, load_config


def _literal(section: str, field: str) -> tuple:
    """The names a config field accepts (the Literal inside Optional / list unwrapped)."""
    annotation = Config.model_fields[section].annotation.model_fields[field].annotation
    while typing.get_origin(annotation) is not typing.Literal:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return typing.get_args(annotation)


@pytest.mark.parametrize(
    "section, field, names",
    [
        ("algo", "name", tuple(choices.ALGO_PRESETS)),
        ("algo", "nav_scope", choices.NAV_SCOPES),
        ("algo", "loss_agg", choices.LOSS_AGGS),
        ("model", "dtype", choices.MODEL_DTYPES),
        ("data", "format", ("auto", *choices.DATA_FORMATS)),
        ("data", "template", choices.PROMPT_TEMPLATES),
        ("eval", "benchmarks", choices.BENCHMARK_NAMES),
        ("schedule", "mode", choices.SCHEDULE_MODES),
    ],
)
def test_config_fields_take_exactly_their_list(section, field, names):
    assert _literal(section, field) == names
    with pytest.raises(ConfigError, match=f"{section}.{field}"):
        load_config(None, [f"{section}.{field}=no_such_name"])


def test_tables_cover_their_lists():
    from mugrpo_async.algo.masks import _NAV_DROP
    from mugrpo_async.data.loaders import FORMATS
    from mugrpo_async.data.prompts import TEMPLATES
    from mugrpo_async.evaluation.benchmarks import BENCHMARKS
    from mugrpo_async.reporting.plan import DTYPE_BYTES

    assert tuple(_NAV_DROP) == choices.NAV_SCOPES
    assert tuple(FORMATS) == choices.DATA_FORMATS
    assert TEMPLATES == choices.PROMPT_TEMPLATES
    assert tuple(BENCHMARKS) == choices.BENCHMARK_NAMES
    assert {b.format for b in BENCHMARKS.values()} <= {*choices.DATA_FORMATS, "heldout", "humaneval"}
    assert tuple(DTYPE_BYTES) == choices.MODEL_DTYPES
    for name, preset in choices.ALGO_PRESETS.items():  # every preset is a valid algo section
        assert load_config(None, [f"algo.name={name}"]).algo.model_dump(include=set(preset)) == preset


def test_every_loss_aggregation_and_veto_scope_runs():
    import torch

    from mugrpo_async.algo import aggregate, nav_mask

    values, mask = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]), torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()
    results = {agg: float(aggregate(values, mask, mask, agg)) for agg in choices.LOSS_AGGS}
    assert results == {"seq_mean_token_mean": (1.5 + 3.0) / 2, "token_mean": 6.0 / 3,
                       "seq_mean_token_sum_norm": (3.0 / 3 + 3.0 / 3) / 2}  # fmt: skip
    log_ratio, advantages = torch.tensor([[0.0, -20.0, 0.0], [0.0, 0.0, 0.0]]), torch.tensor([-1.0, 1.0])
    kept = {s: nav_mask(log_ratio, advantages, mask, 1e-4, s)[0].tolist() for s in choices.NAV_SCOPES}
    assert kept == {"none": [True, True, False], "trigger": [True, False, False], "suffix": [True, True, False],
                    "suffix_nontrigger": [True, True, False], "sequence": [False, False, False]}  # fmt: skip


def test_cli_choices_come_from_the_lists(capsys):
    from launch.eval import _parser
    from launch.train import main

    template = next(a for a in _parser()._actions if "--template" in a.option_strings)
    assert tuple(template.choices) == choices.PROMPT_TEMPLATES
    with pytest.raises(SystemExit) as exit_:
        main(["--mode", "staged"])
    assert exit_.value.code == 2
    assert "[--mode {sync,async}]" in capsys.readouterr().err
