"""The staleness study's run plan: every (variant, seed) with its overrides and status, and the replay of one
variant's stages by the others (``--replay-from``). Pure: configs are loaded, nothing is started.

A fixed rollout set per seed: the source variant generates the stage(s) while it trains; every other variant of
that seed trains on the same stored stages (``rollout.replay_dir=<source>/seed-<s>``,
:mod:`mugrpo_async.rollout.replay`). The source is either a variant of this study (it then runs first in each
seed) or ``<folder>/<variant>`` of another study folder, whose finished runs are read and never run here (the
B_mini sweep of the design replays phase 1's stages this way).

The replay folder is part of each replaying run's overrides, built from ``--out`` the same way as
``run.output_dir``, so every invocation of the same study (``--report-only`` over all seeds included) plans the
same configs and each folder's resume digest matches; ``--out`` must be spelt the same way each time (a relative
and an absolute spelling of one folder are different replay sources to the digest).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mugrpo_async.config import Config, ConfigError, load_config
from mugrpo_async.reporting.study import VARIANTS, Variant, read_run_records, run_status
from mugrpo_async.rollout.replay import GENERATION_KEYS, replay_problems

FIXED = ("run.dashboard=false", "logging.progress=false")
"""Overrides of every study run (after everything else)."""


@dataclass(frozen=True)
class ReplaySource:
    """Where each seed's stages come from.

    Attributes:
        variant: The generating variant's name.
        folder: The folder holding its ``seed-<s>/`` run folders.
        external: True when ``folder`` belongs to another study (read only, never run here).
    """

    variant: str
    folder: Path
    external: bool

    def run_dir(self, seed: int) -> Path:
        return self.folder / f"seed-{seed}"


@dataclass
class PlannedRun:
    """One ``launch.train`` run of the study.

    Attributes:
        variant / seed / path: Variant name, ``run.seed`` and run folder (``<out>/<variant>/seed-<s>``).
        overrides: Every ``dotted.key=value`` of its command line, in order.
        status: :func:`~mugrpo_async.reporting.study.run_status` (``new``, ``partial`` or ``done``).
        budget: (total_updates, B_mini, G).
        replay: The run folder whose stages it trains on (None: it generates its own).
        source: Whether other runs of its seed replay its stages.
    """

    variant: str
    seed: int
    path: Path
    overrides: list[str]
    status: str
    budget: tuple[int, int, int] = (0, 0, 0)
    replay: Path | None = None
    source: bool = False


def replay_source(spec: str | None, out: Path) -> ReplaySource | None:
    """``--replay-from``: a variant name of this study, or ``<study folder>/<variant>`` of another one.

    Raises:
        KeyError: an unknown variant name.
    """
    if not spec:
        return None
    path = Path(spec)
    if len(path.parts) == 1:
        if spec not in VARIANTS:
            raise KeyError(f"--replay-from {spec!r}: not a variant name and not <study folder>/<variant>")
        return ReplaySource(spec, out / spec, external=False)
    return ReplaySource(path.name, path, external=True)


def run_finished(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a finished run: an ``end`` record for its saved config's total updates."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return False
    total = load_config(saved).schedule.total_updates
    ends = [r for r in read_run_records(run_dir) if r.get("kind") == "end"]
    return bool(ends) and ends[-1].get("updates") == total


def _ordered(variants: list[Variant], source: ReplaySource | None) -> list[Variant]:
    """The source variant first (added when not listed), the others in the given order."""
    if source is None or source.external:
        return variants
    return [VARIANTS[source.variant], *(v for v in variants if v.name != source.variant)]


def study_plan(config: str | Path, variants: list[Variant], seeds: list[int], out: Path, overrides: list[str],
               replay_from: str | None = None) -> list[PlannedRun]:  # fmt: skip
    """Every (variant, seed) with its train overrides and status, seed-major; within a seed the replay source
    first.

    Raises:
        KeyError / ValueError / ConfigError: a bad name, seed or config (the message names the variant),
            variants with different samples budgets, or a run folder of another configuration.
    """
    source = replay_source(replay_from, out)
    runs, budgets, source_cfg = [], {}, None
    for seed in seeds:
        for v in _ordered(variants, source):
            path = out / v.name / f"seed-{seed}"
            replay = source.run_dir(seed) if source and (source.external or v.name != source.variant) else None
            ov = [*overrides, *v.overrides, *([f"rollout.replay_dir={replay}"] if replay else []),
                  f"run.seed={seed}", f"run.output_dir={path}", f"run.name=study-{v.name}-s{seed}", *FIXED]  # fmt: skip
            try:
                cfg = load_config(config, ov)
            except ConfigError as err:
                raise ConfigError(f"variant {v.name}: {err}") from None
            budget = (cfg.schedule.total_updates, cfg.schedule.groups_per_update, cfg.rollout.group_size)
            budgets[v.name] = budget
            status = run_status(path, cfg)
            if status == "mismatch":
                raise ConfigError(f"{path} holds a run of another configuration: remove it or choose another --out")
            is_source = source is not None and not source.external and v.name == source.variant
            if is_source:
                source_cfg = cfg
            elif replay is not None and (not source.external or (replay / "config.yaml").is_file()):
                _check_replay(v.name, cfg, None if source.external else source_cfg)
            runs.append(PlannedRun(v.name, seed, path, ov, status, budget, replay, is_source))
    if len(set(budgets.values())) > 1:
        raise ConfigError(f"variants differ in samples budget (updates, B_mini, G): {budgets}")
    return runs


def _value(cfg: Config, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node.model_dump(mode="json") if hasattr(node, "model_dump") else node


def _check_replay(variant: str, cfg: Config, source_cfg: Config | None) -> None:
    """Refuses a replaying variant whose stages would differ from its source's (:data:`GENERATION_KEYS`): against
    the source's planned config (a source of this study) or its saved one (another study's; one not there yet is
    checked when its replays would start, by :func:`replay_blocker` and ``launch.train``).

    Raises:
        ConfigError: naming the variant and every differing key.
    """
    if source_cfg is None:
        problems = replay_problems(cfg)
    else:
        problems = [f"the replay source has {key}={_value(source_cfg, key)!r}, this variant {_value(cfg, key)!r}"
                    for key in GENERATION_KEYS if _value(source_cfg, key) != _value(cfg, key)]  # fmt: skip
    if problems:
        raise ConfigError(f"variant {variant} cannot replay its seed's stages: " + "; ".join(problems))


def replay_blocker(run: PlannedRun) -> str | None:
    """Why ``run`` cannot start now (its replay source has not finished), or None."""
    if run.replay is None or run_finished(run.replay):
        return None
    return f"its replay source {run.replay} has not finished"
