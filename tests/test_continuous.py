"""The async rollout loop without stragglers (unit tier: stand-ins for vLLM's engine and the queue actor).

The real engine runs it in tests/test_async.py, test_faults.py, test_actor_deaths.py and test_progress.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mugrpo_async.rollout import continuous
from mugrpo_async.rollout.continuous import ContinuousLoop, InFlight, Occupancy, WorkerHooks, metered
from mugrpo_async.rollout.progress import Progress

G = 2


@pytest.fixture(autouse=True)
def poll_every_turn(monkeypatch):
    """The stand-in engine steps in microseconds: the loop looks at the queue at every turn."""
    monkeypatch.setattr(continuous, "POLL_S", 0.0)
    monkeypatch.setattr(continuous, "IDLE_SLEEP_S", 0.001)


class FakeLLM:
    """vLLM's ``LLM`` as the loop uses it: ``enqueue``, ``llm_engine.step`` (through ``engine_core.get_output``).

    A prompt's ``meta["steps"]`` is how many engine steps its group takes.
    """

    def __init__(self, max_num_seqs: int = 16):
        self.left: dict[str, int] = {}
        self.next_id, self.running_per_step = 0, []
        core = SimpleNamespace(get_output=self._core_step)
        config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))
        self.llm_engine = SimpleNamespace(step=self._step, engine_core=core, vllm_config=config)

    def enqueue(self, prompts, params, use_tqdm=False):
        assert len(prompts) == len(params)
        ids = []
        for p in prompts:
            rid, self.next_id = str(self.next_id), self.next_id + 1
            self.left[rid] = self.steps_of[tuple(p["prompt_token_ids"])]
            ids.append(f"{rid}-0f3a9c1e")  # the engine's internal id; outputs carry the LLM's own
        return ids

    def _core_step(self):
        self.running_per_step.append(len(self.left))
        outputs = [SimpleNamespace(finish_reason="stop" if left == 1 else None) for left in self.left.values()]
        return SimpleNamespace(outputs=[o for o in outputs for _ in range(G)])  # one per sequence that advanced

    def _step(self):
        self.llm_engine.engine_core.get_output()
        done = []
        for rid in list(self.left):
            self.left[rid] -= 1
            if self.left[rid] == 0:
                del self.left[rid]
                done.append(SimpleNamespace(request_id=rid, finished=True, outputs=[SimpleNamespace(text="t")] * G))
        return done


class FakeQueue:
    """The queue port: grants up to ``budget`` groups, publishes version 1 after ``publish_after`` groups are
    put, stops after ``stop_after``."""

    def __init__(self, budget=10**9, publish_after=None, stop_after=6, engine=None):
        self.budget, self.publish_after, self.stop_after, self.engine = budget, publish_after, stop_after, engine
        self.put_groups, self.refused, self.in_flight_at_put = [], 0, []

    def stopped(self):
        return len(self.put_groups) >= self.stop_after

    def next_eval(self):
        return None

    def latest(self):
        if self.publish_after is not None and len(self.put_groups) >= self.publish_after:
            return 1, "weights-1"
        return 0, None

    def reserve(self, n, version):
        granted = max(0, min(n, self.budget))
        self.budget -= granted
        self.refused += granted < n
        return granted

    def put(self, groups):
        self.put_groups += groups


class FakeRewards:
    def key(self, prompt):
        return prompt["answer"]

    def submit(self, texts, answer):
        pass

    def flush(self):
        pass

    def collect(self, texts, answers):
        return [[1.0] * len(t) for t in texts], 0


def _prompts(steps: list[int]) -> list[dict]:
    """One prompt per entry of ``steps``, then prompts of 2 steps without end."""
    steps = steps + [2] * 100
    return [{"prompt_id": f"p{i}", "prompt_ids": [i], "answer": "1", "meta": {"steps": s}} for i, s in enumerate(steps)]


def _loop(steps: list[int], queue: FakeQueue, target: int):
    fake, prompts = FakeLLM(), _prompts(steps)
    fake.steps_of = {tuple(p["prompt_ids"]): p["meta"]["steps"] for p in prompts}
    engine, held, loads = InFlight(fake, Progress(report_s=0.0)), [0], []
    queue.engine = engine

    def load(weights):
        loads.append(len(engine))  # requests in flight when the weights change: must be none
        held[0] = 1
        return 0.0

    stream = iter(prompts)
    hooks = WorkerHooks(version=lambda: held[0], load=load, evaluate=None, params=lambda p: "params",
                        rewards=FakeRewards(), make_group=lambda p, out, r, v: (p["prompt_id"], v))  # fmt: skip
    loop = ContinuousLoop(engine, queue, hooks, lambda n: [next(stream) for _ in range(n)], target)
    return loop, fake, loads


def _run(loop) -> tuple[list[dict], dict]:
    calls, reports = loop.run(), []
    while True:
        try:
            reports.append(next(calls))
        except StopIteration as stop:
            return reports, stop.value


def test_a_long_response_does_not_empty_the_engine():
    # group 0 takes 12 steps, the others 2: a batch loop would run 1 of 3 slots for 10 steps
    loop, fake, _ = _loop([12] + [2] * 11, FakeQueue(stop_after=20), target=3)
    reports, totals = _run(loop)
    put = loop.port.put_groups
    assert [pid for pid, _ in put[:5]] == ["p1", "p2", "p3", "p4", "p5"]  # each put as soon as it is done
    assert "p0" in {pid for pid, _ in put}
    assert fake.running_per_step[:12] == [3] * 12  # refilled at every step while the long one runs
    assert totals["produced"] == len(put) and totals["drains"] == 1  # stop: the groups in flight finish
    assert reports[0]["busy"] and not reports[-1]["busy"]


def test_weights_load_only_with_no_group_in_flight_and_groups_carry_one_version():
    loop, fake, loads = _loop([5, 3, 3, 4, 3, 2, 2, 2, 2, 2, 2, 2], FakeQueue(publish_after=2, stop_after=8), target=3)
    _, totals = _run(loop)
    assert loads == [0] and totals["drains"] == 2  # one drain for the weights, one at stop
    versions = [v for _, v in loop.port.put_groups]
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
    # p1, p2 were put when version 1 appeared; p0, p3, p4 were in flight and finished under version 0
    assert {pid for pid, v in loop.port.put_groups if v == 0} == {"p0", "p1", "p2", "p3", "p4"}


def test_a_refused_grant_leaves_the_engine_empty_and_the_worker_not_busy():
    queue = FakeQueue(budget=2, stop_after=10**9)
    loop, _, _ = _loop([2] * 4, queue, target=3)
    calls = loop.run()
    reports = [next(calls)]
    while reports[-1]["busy"]:  # busy while its 2 granted groups run, then idle: the queue refuses more
        reports.append(next(calls))
    assert reports[0]["busy"] and reports[-1] == {"busy": False, "tokens": 0, "groups": 2}
    queue.stop_after = 0
    for _ in calls:
        pass
    assert queue.refused >= 1 and loop.t_blocked > 0 and len(queue.put_groups) == 2


def test_occupancy_weights_steps_by_time_and_counts_idle_time_as_empty():
    occ = Occupancy(limit=8)
    occ.step(8, 1.0)
    occ.step(2, 1.0)
    out = occ.summary(wall_s=4.0)
    assert out["engine_occupancy_busy"] == pytest.approx(10 / 16) and out["engine_occupancy"] == pytest.approx(10 / 32)
    assert out["engine_steps"] == 2 and out["max_num_seqs"] == 8


def test_tail_runs_from_the_quantile_response_to_the_last():
    occ = Occupancy(limit=8)
    for t, n in ((1.0, 5), (2.0, 3), (3.0, 1), (7.0, 1)):  # 10 responses: the 9th ends at 3.0, the last at 7.0
        occ.step(8, 1.0, finished=n, at=t)
    assert occ.tail_s() == pytest.approx(4.0) and occ.tail_s(0.5) == pytest.approx(6.0)
    assert Occupancy(limit=8).tail_s() == 0.0


def test_the_drains_occupancy_is_what_the_engine_keeps_while_it_finishes_the_groups_in_flight():
    # group 0 takes 12 steps, the others 2; the queue stops after 4 groups: the drain runs p0 alone, then empty
    loop, fake, _ = _loop([12] + [2] * 11, FakeQueue(stop_after=4), target=3)
    with metered(fake) as meter:
        loop.meter = meter
        _, totals = _run(loop)
    occ = meter.summary(1e-9)  # the engine's own steps, without idle time
    assert totals["drains"] == 1 and 0 < totals["engine_occupancy_drain"] < occ["engine_occupancy_busy"]
    assert loop.drain_seq_s < meter.seq_s
    _, unmetered = _run(_loop([2] * 4, FakeQueue(stop_after=2), target=2)[0])
    assert "engine_occupancy_drain" not in unmetered


def test_metered_reads_every_engine_step_and_restores_the_engine():
    fake = FakeLLM(max_num_seqs=4)
    fake.steps_of = {(0,): 2}
    real = fake.llm_engine.engine_core.get_output
    with metered(fake) as occ:
        fake.enqueue([{"prompt_token_ids": [0]}], ["params"])
        fake.llm_engine.step()
        fake.llm_engine.step()
    assert occ.steps == 2 and occ.limit == 4 and occ.seq_s > 0
    assert [n for _, n in occ.finished] == [G]  # the group's G responses finish in its second step
    assert fake.llm_engine.engine_core.get_output == real
