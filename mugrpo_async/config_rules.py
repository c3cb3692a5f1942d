"""The config's rules across keys: combinations that parse but that a later stage of the run would refuse.

What one key decides alone lives on its field in :mod:`mugrpo_async.config`: finite numbers everywhere
(only ``algo.clip_high`` may be infinite), the loss's bounds as :class:`mugrpo_async.algo.loss.LossSpec`
checks them (0 <= clip_low <= 1 <= clip_high, dual_clip_c > 1, tis_cap >= 1, ...), AdamW's betas in [0, 1).
What needs two or more keys lives here, one function per concern, each returning ``"dotted.key: why, and
what is allowed"`` messages; the config's one validator reports all of them at once
(:func:`config_problems`). Each rule stands for code that would otherwise fail later:

- the trainer: DeepSpeed's CPU accelerator refuses fp16; ranks split the minibatch evenly;
- the data: :func:`mugrpo_async.data.task.generate_problems` levels, the keys of a ``custom`` format
  (:func:`mugrpo_async.data.loaders.load_rows`), the synthetic task's own prompt;
- evaluation: :func:`mugrpo_async.rollout.groups.eval_max_tokens` samples once under greedy decoding;
  ``heldout`` needs a split; code prompts (``humaneval``, ``synthetic_code``) need the code reward;
- the async schedule: the driver asks for update k * sync_every before publishing that version, so the
  previous version must still be within the lag cap (:class:`mugrpo_async.rollout.staleness.LagQueue`);
  ``algo.tis_cap`` needs the behaviour weights the sync trainer holds;
- Ray: resource quantities below its 0.0001 precision are refused when an actor is created;
- placement (:mod:`mugrpo_async.placement`): a tensor-parallel vLLM engine runs its workers on GPUs (vLLM's Ray
  executor has no CPU device); `colocated` gives each trainer rank one device shared with an engine (counts that
  match, GPU shares that fit one device, the staged mode only).

Imports nothing heavy: the config module must import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mugrpo_async.data.steps_task import STEP_LEVELS
from mugrpo_async.data.task import LEVELS

if TYPE_CHECKING:
    from mugrpo_async.config import Config

SYNTHETIC_SOURCES = ("synthetic", "synthetic_steps", "synthetic_code")
"""``data.source`` values whose prompts are generated in code (their own prompt form, a held-out draw)."""

RAY_RESOURCE_PRECISION = 1e-4
"""Ray refuses a non-zero resource request below this (``_validate_resource_quantity``)."""


def _schedule_problems(cfg: Config) -> list[str]:
    s = cfg.schedule
    out = []
    if s.mode == "sync" and s.total_updates % s.mu:
        out.append(f"schedule.total_updates: must be a multiple of schedule.mu ({s.mu}) in sync mode (stages of mu "
                   f"updates), got {s.total_updates}")  # fmt: skip
    if s.mode == "async" and cfg.rollout.replay_dir:
        out.append("rollout.replay_dir: replays the stages of a sync run; set schedule.mode=sync")
    if s.mode == "async" and s.queue_max_groups and s.queue_max_groups < s.groups_per_update:
        out.append(f"schedule.queue_max_groups: must hold one minibatch (schedule.groups_per_update = "
                   f"{s.groups_per_update}) or be 0, got {s.queue_max_groups}")  # fmt: skip
    if s.mode == "async" and s.sync_every > s.mu:
        # Update k * sync_every is asked for before version k * sync_every is published, so version
        # (k - 1) * sync_every must still be within the lag cap mu; otherwise the queue never fills.
        out.append(f"schedule.sync_every: must be <= schedule.mu ({s.mu}) in async mode (groups of the newest "
                   "published weights must stay within the lag cap until the next publish), got "
                   f"{s.sync_every}")  # fmt: skip
    return out


def _trainer_problems(cfg: Config) -> list[str]:
    t, r = cfg.trainer, cfg.rollout
    out = []
    responses = cfg.schedule.groups_per_update * r.group_size
    if responses % t.num_ranks:
        out.append(f"trainer.num_ranks: must divide schedule.groups_per_update x rollout.group_size ({responses} "
                   f"responses per update), got {t.num_ranks}")  # fmt: skip
    if cfg.model.dtype == "float16" and t.gpus_per_rank == 0:
        out.append("model.dtype: float16 needs GPU trainer ranks (trainer.gpus_per_rank > 0): DeepSpeed's CPU "
                   "accelerator refuses fp16: use bfloat16 or float32")  # fmt: skip
    quantities = {"rollout.cpus_per_worker": r.cpus_per_worker, "rollout.gpus_per_worker": r.gpus_per_worker,
                  "trainer.cpus_per_rank": t.cpus_per_rank, "trainer.gpus_per_rank": t.gpus_per_rank}  # fmt: skip
    for key, value in quantities.items():
        if 0 < value < RAY_RESOURCE_PRECISION:
            out.append(f"{key}: below Ray's resource precision {RAY_RESOURCE_PRECISION:g} (use 0 or at least "
                       f"that), got {value:g}")  # fmt: skip
    return out


def _algo_problems(cfg: Config) -> list[str]:
    a = cfg.algo
    out = []
    if a.tis_cap is not None and cfg.schedule.mode == "async":
        out.append("algo.tis_cap: sync mode only, since the async trainer no longer holds the behaviour weights "
                   "of a group served with lag > 0 (unset it, or use schedule.mode sync)")  # fmt: skip
    limit = cfg.rollout.max_new_tokens
    if a.overlong == "soft_penalty" and not 1 <= a.overlong_buffer <= limit:
        out.append(f"algo.overlong_buffer: soft_penalty needs 1 <= buffer <= rollout.max_new_tokens ({limit}), got "
                   f"{a.overlong_buffer}")  # fmt: skip
    return out


def _logging_problems(cfg: Config) -> list[str]:
    from importlib.util import find_spec  # the package is looked up, not imported

    if cfg.logging.wandb and find_spec("wandb") is None:
        return ["logging.wandb: the wandb package is not installed: pip install -e '.[wandb]' (or set it false)"]
    return []


def _data_problems(cfg: Config) -> list[str]:
    d = cfg.data
    out = []
    if d.source in ("file", "code_file") and not d.path:
        out.append(f"data.path: required when data.source is `{d.source}`")
    if d.source in SYNTHETIC_SOURCES and d.template not in ("auto", "none"):
        out.append(f"data.template: `{d.template}` needs data.source `file` (the synthetic task uses its own "
                   "prompt: template `auto` or `none`)")  # fmt: skip
    if d.format == "custom":
        out += [f"data.{key}: required when data.format is `custom`" for key in ("problem_key", "answer_key")
                if not getattr(d, key)]  # fmt: skip
    task, levels = ("multi-step task", STEP_LEVELS) if d.source == "synthetic_steps" else ("synthetic task", LEVELS)
    unknown = sorted(set(d.levels) - set(levels))
    if unknown:
        out.append(f"data.levels: the {task} has levels {list(levels)}, got {unknown}")
    return out


def _eval_problems(cfg: Config) -> list[str]:
    e, d = cfg.eval, cfg.data
    out = []
    if e.temperature == 0 and e.n_samples > 1:
        out.append(f"eval.n_samples: greedy evaluation (eval.temperature 0) samples once per problem: use 0 or 1, "
                   f"got {e.n_samples}")  # fmt: skip
    if "heldout" in e.benchmarks and d.source in ("file", "code_file") and d.heldout_problems == 0:
        out.append("eval.benchmarks: `heldout` evaluates the rows held out of data.path, so "
                   "data.heldout_problems must be >= 1")  # fmt: skip
    if d.heldout_disjoint and d.source not in SYNTHETIC_SOURCES:
        out.append(f"data.heldout_disjoint applies to the synthetic sources; data.source={d.source} holds out "
                   "data.heldout_problems rows instead")  # fmt: skip
    if "heldout" in e.benchmarks and d.source in SYNTHETIC_SOURCES and e.num_problems == 0:
        out.append("eval.num_problems: `heldout` of the synthetic task evaluates this many problems, so it must be "
                   ">= 1")  # fmt: skip
    code = "mugrpo_async.rewards.code:reward"
    if "humaneval" in e.benchmarks and cfg.reward.function != code:
        out.append(f"eval.benchmarks: `humaneval` is scored by running code: it needs reward.function {code} "
                   f"(evaluate it apart from math benchmarks), got {cfg.reward.function}")  # fmt: skip
    if d.source in ("synthetic_code", "code_file") and cfg.reward.function != code:
        out.append(f"reward.function: data.source `{d.source}` is scored by running code: use {code}, got "
                   f"{cfg.reward.function}")  # fmt: skip
    return out


def _placement_problems(cfg: Config) -> list[str]:
    r = cfg.rollout
    out = []
    if cfg.placement.mode == "colocated":
        out += _colocated_problems(cfg)
    if r.tensor_parallel_size > 1 and r.gpus_per_worker == 0:
        out.append(f"rollout.tensor_parallel_size: {r.tensor_parallel_size} shards each engine over that many "
                   "GPUs, so rollout.gpus_per_worker (GPUs per vLLM worker) must be > 0 (an engine on CPU keeps "
                   "1)")  # fmt: skip
    return out


def _weight_sync_problems(cfg: Config) -> list[str]:
    from mugrpo_async.weight_sync import backend_problems

    return backend_problems(cfg.weight_sync.backend, cfg.schedule.mode, cfg.trainer.gpus_per_rank > 0,
                            cfg.placement.mode == "colocated")  # fmt: skip


def _colocated_problems(cfg: Config) -> list[str]:
    """Layouts in which engine i cannot share its devices with trainer ranks i*k .. i*k+k-1."""
    r, t = cfg.rollout, cfg.trainer
    k = r.tensor_parallel_size
    out = []
    if r.num_workers * k != t.num_ranks:
        out.append(f"placement.mode: colocated gives each trainer rank one device that it shares with an engine, so "
                   f"rollout.num_workers x rollout.tensor_parallel_size must equal trainer.num_ranks, got "
                   f"{r.num_workers} x {k} and {t.num_ranks}")  # fmt: skip
    if (t.gpus_per_rank > 0) != (r.gpus_per_worker > 0):
        out.append(f"trainer.gpus_per_rank / rollout.gpus_per_worker: colocated actors share a GPU (both > 0) or run "
                   f"on CPUs (both 0), got {t.gpus_per_rank:g} and {r.gpus_per_worker:g}")  # fmt: skip
    if t.gpus_per_rank + r.gpus_per_worker > 1 + 1e-9:
        out.append(f"trainer.gpus_per_rank / rollout.gpus_per_worker: colocated actors share one GPU, so their "
                   f"shares must sum to at most 1, got {t.gpus_per_rank:g} + {r.gpus_per_worker:g}")  # fmt: skip
    if cfg.schedule.mode != "sync":
        out.append(
            "placement.mode: colocated is the staged (sync) mode's layout, where engines and trainer ranks take "
            "turns on each device; schedule.mode async generates while it trains: use placement.mode split"
        )
    return out


def config_problems(cfg: Config) -> list[str]:
    """Every cross-key problem of ``cfg`` as ``"dotted.key: message"`` (empty: none)."""
    rules = (_schedule_problems, _trainer_problems, _algo_problems, _data_problems, _eval_problems,
             _placement_problems, _logging_problems, _weight_sync_problems)  # fmt: skip
    return [problem for rule in rules for problem in rule(cfg)]
