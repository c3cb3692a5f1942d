"""The async rollout loop: one vLLM engine kept full of groups, each handed on as soon as its G responses are scored.

A group is one engine request of ``n = G`` samples. :class:`InFlight` adds requests through the engine's
request interface (``LLM.enqueue``) and steps the engine itself (``LLMEngine.step``), so a new group starts
as soon as another finishes (vLLM's continuous batching) instead of waiting for the longest response of a
batch. :class:`ContinuousLoop` keeps up to ``target`` groups in flight, each reserved from the sample queue
first (backpressure and the lag budget are the queue's), scores each finished group while the engine runs
its next step, and puts it into the queue at once.

Weights switch at a group boundary, by draining: when newer weights are published (or an evaluation is
requested, or the queue stops) the loop admits no new group, lets the groups in flight finish, and only
then loads the weights. Every token of a group is thus sampled by one policy, the version the group is
tagged with, and its behaviour log-probs are that policy's. Loading between steps with requests in flight
would not give that: their KV cache and their earlier tokens come from the old weights and their later
tokens from the new ones (a mix neither policy samples from), and aborting them to start again under the
new weights throws away the most work exactly on the longest responses. A drain costs one partly empty
engine per published version (every ``schedule.sync_every`` updates), where a batch loop pays it per batch.

Engine occupancy (:class:`Occupancy`) is measured at every engine step: sequences that advanced in the
step over the engine's ``max_num_seqs``, weighted by the step's time, over the loop's whole wall time
(idle time counts as empty) and over the time the engine was stepping.

Ray-free: the sample queue is reached through a :class:`QueuePort`, the worker through :class:`WorkerHooks`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from mugrpo_async.rollout.progress import Progress

POLL_S = 0.05
"""Seconds between two looks at the queue (stop, evaluation, newer weights, a refused grant) while the engine
generates; an empty engine looks at every turn (after a short sleep when nothing was granted)."""

IDLE_SLEEP_S = 0.02
"""Sleep of a loop with an empty engine whose grant was refused (waiting for newer weights or room)."""


class QueuePort(Protocol):
    """The sample queue as one worker's loop calls it (the actor's calls, resolved)."""

    def stopped(self) -> bool: ...

    def next_eval(self) -> dict | None: ...

    def latest(self) -> tuple[int, Any]: ...

    def reserve(self, n: int, version: int) -> int: ...

    def put(self, groups: list) -> None: ...


@dataclass
class WorkerHooks:
    """What the loop needs of its rollout worker.

    Attributes:
        version: the policy version the engine holds now.
        load: loads published weights (the queue's ``latest`` handle); returns the seconds it took.
        evaluate: runs an evaluation request to its end (a generator of progress reports); the engine must be empty.
        params: the sampling parameters of one prompt (G samples, its seed if it has one).
        rewards: the worker's ``RewardMemo`` (``key``, ``submit``, ``flush``, ``collect``).
        make_group: ``(prompt, output, rewards, version) -> Group``.
    """

    version: Callable[[], int]
    load: Callable[[Any], float]
    evaluate: Callable[[dict], Generator]
    params: Callable[[dict], Any]
    rewards: Any
    make_group: Callable[[dict, Any, list, int], Any]


class Occupancy:
    """Running sequences per engine step over ``limit`` (the engine's ``max_num_seqs``), weighted by step time."""

    def __init__(self, limit: int):
        self.limit = limit
        self.seq_s = 0.0  # sum over steps of sequences x step seconds
        self.busy_s = 0.0  # seconds spent in engine steps
        self.steps = 0
        self.finished: list[tuple[float, int]] = []  # (time at the step's end, responses it finished)

    def step(self, sequences: int, seconds: float, finished: int = 0, at: float = 0.0) -> None:
        """One engine step advanced ``sequences`` sequences in ``seconds`` and finished ``finished`` responses,
        ending at time ``at`` (``time.perf_counter``)."""
        self.seq_s += sequences * seconds
        self.busy_s += seconds
        self.steps += 1
        if finished:
            self.finished.append((at, finished))

    def tail_s(self, q: float = 0.9) -> float:
        """The straggler tail: seconds from the step that finished the ``q``-quantile response to the one that
        finished the last (0.0 when nothing finished)."""
        total = sum(n for _, n in self.finished)
        if not total:
            return 0.0
        need, done = q * total, 0
        for t, n in self.finished:
            done += n
            if done >= need:
                return self.finished[-1][0] - t
        return 0.0

    def summary(self, wall_s: float) -> dict:
        """``engine_occupancy`` over ``wall_s`` (idle time counts as empty), ``engine_occupancy_busy`` over the
        stepping time, ``engine_busy_s``, ``engine_steps`` and ``max_num_seqs``."""
        full = self.limit * max(wall_s, self.busy_s)
        busy = self.limit * self.busy_s
        return {
            "engine_occupancy": self.seq_s / full if full > 0 else 0.0,
            "engine_occupancy_busy": self.seq_s / busy if busy > 0 else 0.0,
            "engine_busy_s": self.busy_s, "engine_steps": self.steps, "max_num_seqs": self.limit,
        }  # fmt: skip


def max_num_seqs(llm) -> int:
    """The engine's limit of sequences per step (vLLM's ``scheduler_config.max_num_seqs``)."""
    return int(llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)


@contextmanager
def metered(llm):
    """An :class:`Occupancy` fed by every engine step of ``llm`` while the block runs.

    Reads the engine core's outputs of each step (one per sequence that advanced, what ``LLMEngine.step``
    gets from ``engine_core.get_output``) and times the call, which runs the step in-process.
    """
    meter, core = Occupancy(max_num_seqs(llm)), llm.llm_engine.engine_core
    get_output = core.get_output

    def get_output_metered(*args, **kwargs):
        t0 = time.perf_counter()
        out = get_output(*args, **kwargs)
        t1 = time.perf_counter()
        meter.step(len(out.outputs), t1 - t0, sum(o.finish_reason is not None for o in out.outputs), t1)
        return out

    core.get_output = get_output_metered
    try:
        yield meter
    finally:
        core.get_output = get_output


def _external(request_id: str) -> str:
    """The id ``LLM`` gave a request (its counter), which its outputs carry: vLLM's engine returns from
    ``add_request`` an internal id of that id plus ``-`` and 8 random characters."""
    return str(request_id).partition("-")[0]


class InFlight:
    """Requests in one engine: added one group at a time, stepped here, finished groups handed back."""

    def __init__(self, llm, progress: Progress):
        self.llm, self.progress = llm, progress
        self.requests: dict[str, tuple[dict, int]] = {}  # request id -> (prompt, policy version)

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, prompts: list[dict], params: list, version: int) -> None:
        """Start one request per prompt (G samples each), tagged with the policy version that will sample it."""
        ids = self.llm.enqueue([{"prompt_token_ids": p["prompt_ids"]} for p in prompts], params, use_tqdm=False)
        self.requests.update((_external(i), (p, version)) for i, p in zip(ids, prompts, strict=True))

    def step(self) -> list[tuple[dict, Any, int]]:
        """One engine step; the groups it finished as ``(prompt, output, version)``."""
        done = []
        for out in self.llm.llm_engine.step():  # finished requests only (LLM asks for final outputs)
            if out.finished:
                prompt, version = self.requests.pop(_external(out.request_id))
                done.append((prompt, out, version))
                self.progress.count(groups=1)
        return done


@dataclass
class _Due:
    """What the queue asks for at a boundary: stop, an evaluation, newer weights (each after a drain)."""

    stop: bool = False
    evaluation: dict | None = None
    weights: Any = None


class ContinuousLoop:
    """A rollout worker's async loop (see the module docstring): returns its totals from :meth:`run`.

    Args:
        engine: the worker's :class:`InFlight` engine.
        port: the sample queue.
        hooks: the worker.
        take: the next ``n`` prompts of the worker's own stream.
        target: groups kept in flight (``rollout.batch_groups``).
        meter: the engine's :class:`Occupancy` (:func:`metered`), if measured: the drains' share of it is counted.
    """

    def __init__(self, engine: InFlight, port: QueuePort, hooks: WorkerHooks, take: Callable[[int], list],
                 target: int, meter: Occupancy | None = None):  # fmt: skip
        self.engine, self.port, self.hooks, self.take, self.target = engine, port, hooks, take, target
        self.meter, self.drain_seq_s = meter, 0.0  # sequences x step seconds while draining
        self.scoring: list[tuple[dict, Any, int]] = []  # finished, sent to the scorers, not put yet
        self.produced, self.reward_failures, self.drains = 0, 0, 0
        self.t_sync, self.t_blocked, self.t_drain = 0.0, 0.0, 0.0
        self.refused_at = -float("inf")  # when the queue last refused a grant

    def run(self) -> Generator[dict, None, dict]:
        """Generate until the queue stops; yields progress reports, returns the loop's totals.

        The worker reports busy while groups are in flight and not busy while it waits for a grant or loads
        weights (the driver's stall clock runs only while it is busy).
        """
        progress = self.engine.progress
        busy, next_poll = False, 0.0
        while True:
            now = time.monotonic()
            if not self.engine or now >= next_poll:
                due, next_poll = self._due(), now + POLL_S
                if due is not None:
                    yield from self._drain()
                    if busy:
                        yield progress.end()
                        busy = False
                    if due.stop:
                        break
                    yield from self._act(due)
                    continue
            self._refill(now)
            if not self.engine and not self.scoring:
                if busy:
                    yield progress.end()
                    busy = False
                self._sleep_blocked()
                continue
            if not busy:
                yield progress.begin(time.monotonic())
                busy = True
            self._step()
            report = progress.due(time.monotonic())
            if report is not None:
                yield report
        return self.totals()

    def _due(self) -> _Due | None:
        """Stop, an evaluation request (now taken) or newer weights; None when there is nothing to do."""
        if self.port.stopped():
            return _Due(stop=True)
        request = self.port.next_eval()
        if request is not None:
            return _Due(evaluation=request)
        version, weights = self.port.latest()
        if weights is not None and version > self.hooks.version():
            return _Due(weights=weights)
        return None

    def _act(self, due: _Due) -> Generator[dict, None, None]:
        """With the engine empty: evaluate, then load the newest weights if they are newer than the engine's."""
        if due.evaluation is not None:
            yield from self.hooks.evaluate(due.evaluation)  # loads the evaluated policy's weights
            version, weights = self.port.latest()
            due.weights = weights if weights is not None and version != self.hooks.version() else None
        if due.weights is not None:
            self.t_sync += self.hooks.load(due.weights)

    def _refill(self, now: float) -> None:
        """Reserve and start groups up to the target (after a refusal, ask again only after ``POLL_S``)."""
        free = self.target - len(self.engine)
        if free <= 0 or now - self.refused_at < POLL_S:
            return
        version = self.hooks.version()
        granted = self.port.reserve(free, version)
        if granted < free:
            self.refused_at = now
        if granted:
            prompts = self.take(granted)
            self.engine.add(prompts, [self.hooks.params(p) for p in prompts], version)

    def _sleep_blocked(self) -> None:
        t0 = time.perf_counter()
        time.sleep(IDLE_SLEEP_S)
        self.t_blocked += time.perf_counter() - t0

    def _step(self) -> None:
        """One engine step (when requests are in flight); the groups finished before it are put, those it
        finished go to the scorers (collected after the next step, so scoring overlaps generation)."""
        finished = self.engine.step() if self.engine else []
        self._put_scored()
        rewards = self.hooks.rewards
        for prompt, out, _ in finished:
            rewards.submit([c.text for c in out.outputs], rewards.key(prompt))
        if finished:
            rewards.flush()
        self.scoring = finished

    def _put_scored(self) -> None:
        if not self.scoring:
            return
        rewards = self.hooks.rewards
        texts = [[c.text for c in out.outputs] for _, out, _ in self.scoring]
        scores, failures = rewards.collect(texts, [rewards.key(p) for p, _, _ in self.scoring])
        made = [self.hooks.make_group(p, out, r, v) for (p, out, v), r in zip(self.scoring, scores)]
        self.port.put(made)
        self.produced += len(made)
        self.reward_failures += failures
        self.scoring = []

    def _drain(self) -> Generator[dict, None, None]:
        """Finish, score and put every group in flight (no new one starts)."""
        t0, seq_s0 = time.perf_counter(), self.meter.seq_s if self.meter else 0.0
        if self.engine:
            self.drains += 1
        while self.engine or self.scoring:
            self._step()
            report = self.engine.progress.due(time.monotonic())
            if report is not None:
                yield report
        self.t_drain += time.perf_counter() - t0
        self.drain_seq_s += self.meter.seq_s - seq_s0 if self.meter else 0.0

    def totals(self) -> dict:
        """``produced`` (groups put), ``reward_failures``, ``t_weight_sync_s``, ``t_blocked_s`` (engine empty,
        no grant), ``drains`` and ``t_drain_s`` (finishing the groups in flight before a switch), and with a meter
        ``engine_occupancy_drain``: running sequences over ``max_num_seqs`` while draining (what a drain leaves
        of the engine, against ``engine_occupancy_busy`` over all its steps)."""
        out = {"produced": self.produced, "reward_failures": self.reward_failures, "t_weight_sync_s": self.t_sync,
               "t_blocked_s": self.t_blocked, "drains": self.drains, "t_drain_s": self.t_drain}  # fmt: skip
        if self.meter is not None:
            cap = self.meter.limit * self.t_drain
            out["engine_occupancy_drain"] = self.drain_seq_s / cap if cap > 0 else 0.0
        return out
