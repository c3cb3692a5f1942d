"""The resolved plan of a run and its memory estimate, computed from the config alone (no Ray, no torch).

``python -m launch.train --config X --dry-run`` prints :func:`format_plan` of :func:`build_plan`: the
actors and their resources, the schedule, the batch sizes, and per-device memory estimates.

Memory model (bytes; Psi = parameter count, w = bytes per element of ``model.dtype``, N = trainer ranks,
the model-state accounting of the ZeRO paper, Rajbhandari et al. 2020, arXiv:1910.02054):

- weights:    ``w * Psi``, divided by N under ZeRO-3;
- gradients:  ``w * Psi``, divided by N under ZeRO-2 and ZeRO-3;
- optimizer:  ``K * Psi``, divided by N under ZeRO-1, 2 and 3, with K = 8 for AdamW's fp32 m and v
  plus 4 for the fp32 master copy when the weights are not fp32 (K = 12 for bf16 / fp16);
- reference model (only when ``algo.kl_coef > 0``): another ``w * Psi`` per rank;
- vLLM KV cache of one rollout worker for a full minibatch, ``B_mini * G`` sequences at the whole
  context ``data.max_prompt_tokens + rollout.max_new_tokens``:
  ``2 (K and V) * layers * kv_heads * head_dim * w`` bytes per token; plus the engine's own copy of
  the weights, ``w * Psi``.

Host memory of a sync stage and the trainer's logits peak: :func:`host_memory` and :func:`logits_peak`. The
estimates live in `mugrpo_async.reporting.memory`.

Activations, temporary buffers and allocator fragmentation are not included. Example: a 7.6B bf16
model under ZeRO-2 on 8 ranks holds 15.2 GB of weights, 1.9 GB of gradients and 11.4 GB of optimizer
states per rank.

Parameter counts come from the model folder's ``config.json`` when it exists, else from
:data:`KNOWN_ARCHITECTURES` (published numbers of the paper's models, keyed by the folder's basename).
"""

from __future__ import annotations

import dataclasses

from mugrpo_async.config import Config
from mugrpo_async.placement import Bundle, Placement
from mugrpo_async.reporting.memory import (  # noqa: F401  (re-exported: the plan's memory model)
    DTYPE_BYTES,
    KNOWN_ARCHITECTURES,
    Architecture,
    GiB,
    architecture_from_config,
    host_memory,
    logits_peak,
    resolve_architecture,
    trainer_memory,
)
from mugrpo_async.rollout.staleness import describe_lag_bound
from mugrpo_async.weight_sync import describe_backend


@dataclasses.dataclass
class Plan:
    """Everything the dry run prints; memory fields are None when the model's sizes are unknown."""

    cfg: Config
    arch: Architecture | None
    arch_source: str
    folder_note: str
    num_params: int | None = None
    trainer: dict[str, int] | None = None
    reference_model: int = 0
    engine_weights: int | None = None
    kv_cache: int | None = None
    kv_per_token: int | None = None

    @property
    def context_tokens(self) -> int:
        """Prompt plus response tokens (the engine's ``max_model_len``)."""
        return self.cfg.data.max_prompt_tokens + self.cfg.rollout.max_new_tokens

    @property
    def batch_sequences(self) -> int:
        """Sequences of one minibatch: B_mini * G."""
        return self.cfg.schedule.groups_per_update * self.cfg.rollout.group_size


def build_plan(cfg: Config) -> Plan:
    """Resolves the plan of ``cfg`` (reads at most the model folder's config.json)."""
    arch, source, note = resolve_architecture(cfg.model.path)
    plan = Plan(cfg, arch, source, note)
    if arch is None:
        return plan
    w = DTYPE_BYTES[cfg.model.dtype]
    plan.num_params = arch.num_parameters()
    t = cfg.trainer
    plan.trainer = trainer_memory(plan.num_params, cfg.model.dtype, t.zero_stage, t.num_ranks)
    plan.reference_model = w * plan.num_params if cfg.algo.kl_coef > 0 else 0
    plan.engine_weights = w * plan.num_params
    plan.kv_per_token = arch.kv_bytes_per_token(w)
    plan.kv_cache = plan.kv_per_token * plan.batch_sequences * plan.context_tokens
    return plan


def _gib(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (GiB at most)."""
    for unit, size in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,}"


def _actor_lines(cfg: Config) -> list[str]:
    r, t = cfg.rollout, cfg.trainer
    k = r.tensor_parallel_size
    cpus = r.num_workers * r.cpus_per_worker + t.num_ranks * t.cpus_per_rank
    gpus = r.num_workers * k * r.gpus_per_worker + t.num_ranks * t.gpus_per_rank
    engine_gpus = f"{k} x {r.gpus_per_worker:g} GPU" if k > 1 else f"{r.gpus_per_worker:g} GPU"
    return [
        f"rollout workers   {r.num_workers} x ({r.cpus_per_worker:g} CPU, {engine_gpus}), one vLLM engine each"
        + (f" (tensor parallel {k})" if k > 1 else ""),
        f"trainer ranks     {t.num_ranks} x ({t.cpus_per_rank:g} CPU, {t.gpus_per_rank:g} GPU), "
        f"DeepSpeed ZeRO-{t.zero_stage}, {cfg.trainer_threads} torch thread(s) each",
        f"total             {cpus:g} CPUs, {gpus:g} GPUs (reward scorers reserve none)",
    ]


def async_lag_bound(cfg: Config) -> str:
    """What bounds the async lag: the cap mu or the queue (see
    :func:`~mugrpo_async.rollout.staleness.describe_lag_bound`)."""
    s, r = cfg.schedule, cfg.rollout
    in_flight = r.num_workers * r.batch_groups
    return describe_lag_bound(s.mu, s.sync_every, s.queue_capacity, in_flight, s.groups_per_update)


def _schedule_lines(cfg: Config) -> list[str]:
    s, a, r = cfg.schedule, cfg.algo, cfg.rollout
    lines = [f"mode              {s.mode}, algo {a.name} (ratio bounds [{a.clip_low:g}, {a.clip_high:g}], "
             f"veto {a.nav_scope}, tau {a.nav_tau:g}, kl_coef {a.kl_coef:g})"]  # fmt: skip
    if s.mode == "sync":
        lines.append(f"schedule          mu {s.mu}, {s.num_stages} stages of mu updates (sync_every {s.sync_every}: "
                     "async only)")  # fmt: skip
    else:
        lines.append(
            f"schedule          mu {s.mu} (lag cap), weights published every sync_every {s.sync_every} "
            f"updates ({-(-s.total_updates // s.sync_every)} publishes), queue {s.queue_capacity} groups"
        )
        lines.append(f"lag bound         {async_lag_bound(cfg)}")
    b_train = f"B_train {s.groups_per_stage} groups (mu x B_mini)" if s.mode == "sync" else "B_train n/a (async)"
    lines += [
        f"total updates     {s.total_updates}",
        f"batch             B_mini {s.groups_per_update} groups x G {r.group_size} = "
        f"{s.groups_per_update * r.group_size} responses per update; {b_train}",
        f"per rank          {cfg.responses_per_rank} responses per update = {cfg.micro_batches_per_rank} "
        f"micro-batches of <= {cfg.trainer.micro_batch_size}",
    ]
    t = cfg.trainer
    if t.max_tokens_per_micro_batch:
        lines[-1] = (f"per rank          {cfg.responses_per_rank} responses per update (balanced by tokens), "
                     f"micro-batches of <= {t.max_tokens_per_micro_batch} padded tokens")  # fmt: skip
    return lines


def _memory_lines(plan: Plan) -> list[str]:
    cfg, arch = plan.cfg, plan.arch
    if arch is None or plan.trainer is None:
        return [f"memory            not estimated: {plan.arch_source}"]
    t, r = cfg.trainer, cfg.rollout
    master = " + fp32 master" if DTYPE_BYTES[cfg.model.dtype] < 4 else ""
    # A tensor-parallel engine splits its weights over k GPUs, and its KV heads (each GPU keeps at least one).
    k = r.tensor_parallel_size
    kv_heads = max(1, arch.num_kv_heads // k)
    engine_weights = -(-plan.engine_weights // k)
    kv_cache, kv_per_token = (x * kv_heads // arch.num_kv_heads for x in (plan.kv_cache, plan.kv_per_token))
    per_gpu = f" per GPU of {k}" if k > 1 else ""
    total = sum(plan.trainer.values()) + plan.reference_model
    chunk = f"chunks of {t.logprob_chunk_tokens} positions" if t.logprob_chunk_tokens else "unchunked"
    host = host_memory(cfg) if cfg.schedule.mode == "sync" else None
    lines = [
        f"model size        {_count(plan.num_params)} parameters, {cfg.model.dtype}; {plan.arch_source}",
        "memory            estimates per trainer rank / rollout worker (its GPU; host memory without one), "
        "activations not included",
        f"  trainer rank    weights {_gib(plan.trainer['weights'])}, gradients {_gib(plan.trainer['gradients'])}, "
        f"optimizer (AdamW fp32 m, v{master}) {_gib(plan.trainer['optimizer'])}"
        + (f", reference model {_gib(plan.reference_model)}" if plan.reference_model else "")
        + f"; total {_gib(total)}",
        f"  logits peak     {_gib(logits_peak(cfg, arch))} per micro-batch on a trainer rank ({chunk})",
        f"  host (stage)    driver {_gib(host['driver'])}, trainer rank {_gib(host['trainer_rank'])}, engine actor "
        f"{_gib(host['engine_actor'])}; every response at max_new_tokens" if host else "  host (stage)    n/a (async)",
        f"  rollout worker  weights {_gib(engine_weights)}, KV cache {_gib(kv_cache)} for "
        f"{plan.batch_sequences} sequences x {plan.context_tokens} tokens ({_gib(kv_per_token)} per "
        f"token); total {_gib(engine_weights + kv_cache)}{per_gpu} (vLLM runs what its cache holds, queues the "
        "rest)",
    ]  # fmt: skip
    lines += _colocated_lines(cfg)
    for who, gpus in (("trainer rank", t.gpus_per_rank), ("rollout worker", r.gpus_per_worker)):
        if 0 < gpus < 1 and cfg.placement.mode != "colocated":
            lines.append(f"  note            {round(1 / gpus):g} {who}s share one GPU ({gpus:g} GPU each)")
    if arch.max_position_embeddings and plan.context_tokens > arch.max_position_embeddings:
        lines.append(f"  warning         context {plan.context_tokens} exceeds the model's max_position_embeddings "
                     f"{arch.max_position_embeddings}")  # fmt: skip
    if arch.num_heads % k or (arch.num_kv_heads % k and k % arch.num_kv_heads):  # vLLM's own rule
        lines.append(f"  warning         rollout.tensor_parallel_size {k} does not split the model's {arch.num_heads} "
                     f"attention heads / {arch.num_kv_heads} KV heads evenly: vLLM refuses it")  # fmt: skip
    return lines


def _colocated_lines(cfg: Config) -> list[str]:
    """Colocated devices: what each holds in the rollout and the training phase (`mugrpo_async.colocation`)."""
    from mugrpo_async.colocation import offload_unsupported, phase_memory

    phases = phase_memory(cfg) if cfg.placement.mode == "colocated" else None
    if phases is None:
        return []
    ro, tr = phases["rollout"], phases["training"]
    kept = offload_unsupported(cfg.trainer.zero_stage, True, True)
    states = (f"optimizer {_gib(ro.optimizer)} and gradients {_gib(ro.gradients)} kept ({kept})" if kept
              else "optimizer states and gradients offloaded to host memory")  # fmt: skip
    return [
        "  per GPU (colocated: rollout worker i and trainer rank i share GPU i)",
        f"    rollout phase  engine weights {_gib(ro.engine_weights)} + KV cache {_gib(ro.kv_cache)} + trainer weights "
        f"{_gib(ro.trainer_weights)}; {states}; total {_gib(ro.total)}",
        f"    training phase trainer weights {_gib(tr.trainer_weights)} + gradients {_gib(tr.gradients)} + optimizer "
        f"{_gib(tr.optimizer)}; engine asleep (level 2: weights and KV cache released); total {_gib(tr.total)}",
    ]  # fmt: skip


def format_plan(plan: Plan) -> str:
    """The plan as aligned text lines (what ``--dry-run`` prints)."""
    cfg = plan.cfg
    model = f"model             {cfg.model.path} ({cfg.model.dtype})"
    if plan.folder_note:
        model += f"; {plan.folder_note}"
    context = f"context           {cfg.data.max_prompt_tokens} prompt + {cfg.rollout.max_new_tokens} response tokens"
    if plan.arch is not None and plan.arch.max_position_embeddings:
        context += f" = {plan.context_tokens} (model max {plan.arch.max_position_embeddings})"
    lines = [
        f"run               {cfg.run.name} -> {cfg.run.output_dir}",
        model,
        *_actor_lines(cfg),
        *_schedule_lines(cfg),
        describe_backend(
            cfg.weight_sync.backend,
            cfg.schedule.mode,
            cfg.trainer.gpus_per_rank > 0,
            cfg.placement.mode == "colocated",
            cfg.weight_sync.bucket_mb,
        ),
        context,
        *_memory_lines(plan),
    ]
    return "\n".join(lines)


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def _amounts(bundles: list[Bundle]) -> str:
    cpus, gpus = sum(b.cpus for b in bundles), sum(b.gpus for b in bundles)
    return f"{cpus:g} CPU{'s' * (cpus != 1)}, {gpus:g} GPU{'s' * (gpus != 1)}"


def format_placement(placement: Placement, cfg: Config) -> str:
    """Where each actor goes: its bundles of the run's one placement group and their node (what ``--dry-run
    --cluster`` prints, and what a run logs before it reserves them)."""
    p = placement
    lines = [f"placement         {cfg.placement.mode}: {len(p.bundles)} bundles in one placement group, on "
             f"{len(p.used_nodes())} of {len(p.nodes)} node(s); trainer ranks on {len(p.trainer_nodes())}"]  # fmt: skip
    for i, node in enumerate(p.nodes):
        ranks = [s.index for s in p.trainers if s.node == i]
        engines = [s.index for s in p.engines if s.node == i]
        held = ([f"trainer ranks {_ranges(ranks)}"] if ranks else []) + (
            [f"rollout workers {_ranges(engines)}"] if engines else [])  # fmt: skip
        reserved = _amounts([b for b in p.bundles if b.node == i]) + " reserved" if held else "nothing reserved"
        lines.append(f"  {node.name:<15} {node.describe()}: {', '.join(held + [reserved])}")
    for s in p.trainers:
        (b,) = (p.bundles[j] for j in s.bundles)
        meet = "; the group meets at this node's address" if s.index == 0 else ""
        if cfg.placement.mode == "colocated":
            meet += f"; device shared with rollout worker {s.index // cfg.rollout.tensor_parallel_size}"
        lines.append(f"  trainer rank {s.index:<2} bundle {b.index} on {p.nodes[s.node].name} ({_amounts([b])}){meet}")
    for s in p.engines:
        mine = [p.bundles[j] for j in s.bundles]
        where = f"bundle {s.bundles[0]}" if len(mine) == 1 else f"bundles {_ranges(list(s.bundles))}"
        tp = f"; tensor parallel {len(mine)}, one vLLM worker per bundle" if len(mine) > 1 else ""
        lines.append(f"  rollout worker {s.index} {where} on {p.nodes[s.node].name} ({_amounts(mine)}){tp}")
    return "\n".join(lines)
