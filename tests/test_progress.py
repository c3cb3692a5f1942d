"""Hangs detected by progress, chunks bounded in tokens, evaluation spread over workers.

Unit tier: the stall rule (worker counters and the driver's watch), the chunk plan and the evaluation split
and merge, with stand-ins for vLLM's outputs. Integration tier (real Ray and vLLM, the tiny model): an engine
that stops making progress gets its worker restarted and its chunk generated again; an engine that keeps
generating longer than the stall timeout is not touched; an evaluation spread over two workers gives the
records of one worker.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mugrpo_async.evaluation.shares import merge_eval, split_eval
from mugrpo_async.rollout.chunks import ChunkPlan, chunk_plan, plan_for_stage
from mugrpo_async.rollout.progress import Progress, StallWatch, new_tokens, report_interval

# ---------------------------------------------------------------- worker side: counting progress


def test_new_tokens_counts_the_tokens_of_one_engine_step():
    # vLLM's EngineCoreOutput: one per request that advanced in the step (several tokens with speculation)
    step = [SimpleNamespace(request_id="0", new_token_ids=[5]), SimpleNamespace(request_id="1", new_token_ids=[7, 8])]
    assert new_tokens(step) == 3 and new_tokens([]) == 0


def test_progress_counts_tokens_and_groups_over_the_workers_life():
    p = Progress(report_s=1.0)
    assert p.begin(0.0) == {"busy": True, "tokens": 0, "groups": 0}
    p.count(tokens=3)
    p.count(tokens=2, groups=1)
    assert p.end() == {"busy": False, "tokens": 5, "groups": 1}
    assert p.begin(5.0) == {"busy": True, "tokens": 5, "groups": 1}  # a new call: the counters go on


def test_progress_reports_only_when_a_counter_moved_and_at_most_once_per_interval():
    p = Progress(report_s=2.0)
    p.begin(10.0)
    assert p.due(13.0) is None  # nothing moved: a stalled worker goes quiet
    p.count(tokens=1)
    assert p.due(11.0) is None  # moved, but too soon after the begin report
    assert p.due(12.0) == {"busy": True, "tokens": 1, "groups": 0}
    p.count(groups=1)
    assert p.due(13.9) is None and p.due(14.0) == {"busy": True, "tokens": 1, "groups": 1}


def test_report_interval_is_a_quarter_of_the_stall_timeout_and_at_most_ten_seconds():
    assert report_interval(8.0) == 2.0 and report_interval(600.0) == 10.0


# ---------------------------------------------------------------- driver side: the stall rule


def test_a_busy_call_stalls_when_its_counters_do_not_move_for_the_timeout():
    w = StallWatch(timeout_s=5.0)
    w.start("a", now=0.0)
    assert w.wait_s(1.0) == 4.0 and w.stalled(4.9) == []
    w.observe("a", {"busy": True, "tokens": 10, "groups": 0}, now=4.0)  # first tokens: the clock restarts
    assert w.stalled(8.9) == [] and w.wait_s(6.0) == 3.0
    w.observe("a", {"busy": True, "tokens": 10, "groups": 0}, now=8.0)  # the same counters: no progress
    assert w.stalled(9.0) == ["a"] and w.wait_s(9.5) == 0.0
    assert "for 5s" in w.describe("a", 9.0) and "10 tokens and 0 groups" in w.describe("a", 9.0)


def test_a_finished_group_is_progress_too():
    w = StallWatch(timeout_s=5.0)
    w.start("a", now=0.0)
    w.observe("a", {"busy": True, "tokens": 10, "groups": 0}, now=1.0)
    w.observe("a", {"busy": True, "tokens": 10, "groups": 1}, now=5.0)
    assert w.stalled(9.0) == [] and w.stalled(10.0) == ["a"]


def test_a_call_that_hangs_before_its_first_report_stalls_from_its_submission():
    w = StallWatch(timeout_s=5.0)
    w.start("a", now=2.0)
    assert w.stalled(6.9) == [] and w.stalled(7.0) == ["a"]
    assert "no report yet" in w.describe("a", 7.0)


def test_a_long_call_that_keeps_generating_never_stalls():
    w = StallWatch(timeout_s=5.0)
    w.start("a", now=0.0)
    for t in range(1, 1000):  # an hour-long call, a token report every 4 s
        w.observe("a", {"busy": True, "tokens": t, "groups": 0}, now=4.0 * t)
        assert w.stalled(4.0 * t + 4.9) == []


def test_an_idle_call_has_no_clock_until_it_reports_busy():
    w = StallWatch(timeout_s=5.0)
    w.start("loop", now=0.0, busy=False)  # an async loop waiting for a grant or weights
    assert w.stalled(1000.0) == [] and w.wait_s(1000.0) is None
    w.observe("loop", {"busy": True, "tokens": 7, "groups": 2}, now=1000.0)  # its engine starts: the clock runs
    assert w.wait_s(1001.0) == 4.0 and w.stalled(1005.0) == ["loop"]
    w.observe("loop", {"busy": False, "tokens": 9, "groups": 3}, now=1006.0)  # done: idle again
    assert w.stalled(5000.0) == []
    w.observe("loop", {"busy": True, "tokens": 9, "groups": 3}, now=6000.0)  # busy again, same counters
    assert w.stalled(6004.0) == [] and w.stalled(6005.0) == ["loop"]


def test_stalled_lists_the_oldest_first_and_forget_stops_watching():
    w = StallWatch(timeout_s=1.0)
    w.start("late", now=5.0)
    w.start("early", now=0.0)
    w.start("fresh", now=9.5)
    assert w.stalled(10.0) == ["early", "late"]
    w.forget("early")
    w.observe("early", {"busy": True, "tokens": 1, "groups": 0}, now=10.0)  # a late report of a forgotten call
    assert w.stalled(10.0) == ["late"] and w.wait_s(10.0) == 0.0


# ---------------------------------------------------------------- the chunk plan


def test_chunk_plan_default_is_two_calls_per_worker():
    assert chunk_plan(64, 2, 8, 16) == ChunkPlan(16, 4)
    assert chunk_plan(65, 2, 8, 16) == ChunkPlan(17, 4)  # the last chunk is smaller
    assert chunk_plan(3, 4, 8, 16) == ChunkPlan(1, 3)


def test_chunk_plan_from_a_token_budget_is_bounded_in_response_tokens():
    # The paper's stage: 32,768 groups of 8 x up to 8,192 tokens on 4 workers; a 2^24-token budget: 256 groups.
    plan = chunk_plan(32768, 4, 8, 8192, chunk_tokens=2**24)
    assert plan == ChunkPlan(256, 128)
    assert plan.chunk_size * 8 * 8192 <= 2**24
    assert chunk_plan(32768, 4, 8, 8192) == ChunkPlan(4096, 8)  # unset: two calls of 4,096 groups per worker
    assert chunk_plan(1000, 4, 8, 8192, chunk_tokens=100) == ChunkPlan(1, 1000)  # at least one group
    # At most the default, so that every worker still gets work in a small stage.
    assert chunk_plan(64, 4, 8, 16, chunk_tokens=10**9) == ChunkPlan(8, 8)


def test_chunk_groups_overrides_the_token_budget():
    assert chunk_plan(64, 2, 8, 16, chunk_groups=5, chunk_tokens=8 * 16 * 2) == ChunkPlan(5, 13)
    assert chunk_plan(64, 2, 8, 16, chunk_groups=100) == ChunkPlan(64, 1)
    with pytest.raises(ValueError):
        chunk_plan(0, 2, 8, 16)


def test_a_stage_begun_earlier_keeps_its_stored_plan():
    new = ChunkPlan(8, 8)
    assert plan_for_stage({"chunk_size": 16, "num_chunks": 4}, new) == ChunkPlan(16, 4)
    assert plan_for_stage(None, new) == new and plan_for_stage({"chunk_size": None, "num_chunks": None}, new) == new
    assert ChunkPlan(3, 3).chunk(list(range(7)), 2) == [6]


def test_a_reopened_stage_keeps_its_plan_when_the_workers_or_the_budget_changed(tmp_path):
    from drivers.sync import _stage_plan
    from mugrpo_async.config import load_config
    from mugrpo_async.rollout.shards import StageWriter

    cfg = load_config(None, ["schedule.mu=4", "schedule.groups_per_update=8", "rollout.max_new_tokens=16"])
    stage = tmp_path / "stage-0"
    first = _stage_plan(cfg, stage, 32, 2)
    assert first == ChunkPlan(8, 4)
    assert _stage_plan(cfg, stage, 32, 4) == ChunkPlan(4, 8)  # begun, nothing written: a new plan
    StageWriter.open(stage, 0, cfg.resume_digest(), first.num_chunks, first.chunk_size).add_wall(1.0)  # written
    # Resumed with 4 workers and a token budget of 2 groups a chunk: neither is in the resume digest, and the
    # stage goes on with the plan its manifest holds (its shards are the chunks of that plan).
    other = load_config(None, ["schedule.mu=4", "schedule.groups_per_update=8", "rollout.max_new_tokens=16",
                               "rollout.num_workers=4", f"rollout.chunk_tokens={2 * 8 * 16}"])  # fmt: skip
    again = _stage_plan(other, stage, 32, 4)
    assert again == first and other.resume_digest() == cfg.resume_digest()
    StageWriter.open(stage, 0, other.resume_digest(), again.num_chunks, again.chunk_size)  # accepted
    assert _stage_plan(other, tmp_path / "stage-1", 32, 4) == ChunkPlan(2, 16)  # a new stage: the new rule


def test_chunk_tokens_is_a_config_key_outside_the_resume_digest():
    from mugrpo_async.config import ConfigError, load_config

    base = load_config(None)
    cfg = load_config(None, ["rollout.chunk_tokens=4096", "rollout.stall_timeout_s=30", "rollout.restart_timeout_s=60"])
    assert (cfg.rollout.chunk_tokens, cfg.rollout.stall_timeout_s, cfg.rollout.restart_timeout_s) == (4096, 30, 60)
    assert cfg.resume_digest() == base.resume_digest()  # the plan is in the manifest; timeouts never count
    assert load_config(None, ["rollout.chunk_groups=4"]).resume_digest() != base.resume_digest()
    for bad in ("rollout.stall_timeout_s=0", "rollout.chunk_tokens=-1", "rollout.generate_timeout_s=5"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [bad])


# ---------------------------------------------------------------- the evaluation split and merge


def _requests() -> dict:
    def bench(name, count, n, max_new_tokens):
        prompts = [{"prompt_id": f"{name}-{i}", "prompt_ids": [i], "answer": str(i)} for i in range(count)]
        return {"prompts": prompts, "n": n, "temperature": 1.0, "max_new_tokens": max_new_tokens}

    # The paper's evaluation, scaled down: two costly benchmarks of few problems, one cheap one of many.
    return {"aime24": bench("aime24", 3, 16, 8), "amc23": bench("amc23", 4, 4, 8),
            "math500": bench("math500", 10, 4, 8)}  # fmt: skip


def _cost(share: dict) -> int:
    return sum(len(b["index"]) * b["n"] * b["max_new_tokens"] for b in share.values())


def test_split_covers_every_problem_once_balanced_by_expected_tokens():
    requests = _requests()
    shares = split_eval(requests, 3)
    assert len(shares) == 3
    for name, r in requests.items():
        got = sorted(i for s in shares for i in s.get(name, {"index": []})["index"])
        assert got == list(range(len(r["prompts"])))
    costs = [_cost(s) for s in shares]  # 3 x 128 + 4 x 32 + 10 x 32 = 832 tokens
    assert sum(costs) == 832 and max(costs) - min(costs) <= 128  # within one problem of the costliest kind
    for s in shares:
        for name, part in s.items():
            assert part["index"] == sorted(part["index"])
            assert part["prompts"] == [requests[name]["prompts"][i] for i in part["index"]]
            assert (part["n"], part["temperature"], part["max_new_tokens"]) == (
                requests[name]["n"], 1.0, requests[name]["max_new_tokens"])  # fmt: skip
    assert [list(s) for s in split_eval(requests, 1)] == [["aime24", "amc23", "math500"]]


def test_split_into_more_shares_than_problems_leaves_none_empty():
    requests = {"gsm8k": _requests()["aime24"]}
    shares = split_eval(requests, 8)
    assert [s["gsm8k"]["index"] for s in shares] == [[0], [1], [2]]
    assert split_eval({"gsm8k": {**requests["gsm8k"], "prompts": []}}, 4) == []
    with pytest.raises(ValueError):
        split_eval(requests, 0)


def test_merge_restores_problem_order_whatever_the_split():
    requests = _requests()

    def evaluate(share):  # what a worker returns: one record per problem of each benchmark, in share order
        return {name: [{"prompt_id": p["prompt_id"]} for p in part["prompts"]] for name, part in share.items()}

    one = merge_eval(requests, split_eval(requests, 1), [evaluate(s) for s in split_eval(requests, 1)])
    for k in (2, 3, 5, 17):
        shares = split_eval(requests, k)
        assert merge_eval(requests, shares, [evaluate(s) for s in shares]) == one
    assert [r["prompt_id"] for r in one["amc23"]] == [f"amc23-{i}" for i in range(4)]


def test_merge_refuses_missing_or_mismatched_records():
    requests = _requests()
    shares = split_eval(requests, 2)
    results = [{name: [{}] * len(part["index"]) for name, part in s.items()} for s in shares]
    short = [dict(results[0], math500=results[0]["math500"][:-1]), results[1]]
    with pytest.raises(ValueError, match="records for"):
        merge_eval(requests, shares, short)
    with pytest.raises(ValueError, match="no record"):
        merge_eval(requests, shares[:1], results[:1])
    with pytest.raises(ValueError, match="twice"):
        merge_eval(requests, [shares[0], shares[0]], [results[0], results[0]])


# ---------------------------------------------------------------- integration: real Ray and vLLM, the tiny model


def _stalls_after(steps: int):
    """For ``worker.__ray_call__``: the engine makes ``steps`` more steps, then never finishes another."""

    def install(worker) -> None:
        import threading

        real, never, done = worker.llm.llm_engine.step, threading.Event(), [0]

        def step(*args, **kwargs):
            if done[0] >= steps:
                never.wait()
            done[0] += 1
            return real(*args, **kwargs)

        worker.llm.llm_engine.step = step

    return install


def _slow_steps(seconds: float):
    """For ``worker.__ray_call__``: every engine step takes ``seconds`` longer (a long, healthy generation)."""

    def install(worker) -> None:
        import time

        real = worker.llm.llm_engine.step

        def step(*args, **kwargs):
            time.sleep(seconds)
            return real(*args, **kwargs)

        worker.llm.llm_engine.step = step

    return install


def _plain_steps(worker) -> None:
    """For ``worker.__ray_call__``: the engine's own ``step`` again."""
    del worker.llm.llm_engine.step  # the wrappers set an instance attribute over the class's method


STALL_S = 3.0
"""The workers' stall timeout (they report progress every STALL_S / 4)."""


@pytest.mark.slow
def test_an_async_worker_whose_engine_stalls_is_restarted_and_the_run_completes(
    tiny_model, ray_cluster, tmp_path, monkeypatch
):
    from drivers import asynchronous
    from mugrpo_async.reporting.metrics import read_metrics
    from tests.conftest import tiny_config

    stalled, real = [], asynchronous._Loops._start

    def start(loops, worker, cursor):
        if not stalled:  # the first loop's engine makes three steps, then hangs
            ray_cluster.get(worker.__ray_call__.remote(_stalls_after(3)))
            stalled.append(cursor)
        return real(loops, worker, cursor)

    monkeypatch.setattr(asynchronous._Loops, "_start", start)
    out = tmp_path / "async-stall"
    cfg = tiny_config(tiny_model, out, ["run.name=astall", "schedule.mode=async", "schedule.total_updates=4",
                                        "schedule.mu=4", "schedule.sync_every=2", "rollout.batch_groups=4",
                                        f"rollout.stall_timeout_s={STALL_S}", "rollout.max_restarts=1",
                                        "schedule.get_timeout_s=180"])  # fmt: skip
    end = asynchronous.run_async(cfg)
    assert stalled == [0] and end["worker_restarts"] == 1  # killed for its silence, restarted, its loop again
    assert [r["update"] for r in read_metrics(out, "update")] == [1, 2, 3, 4]
    assert end["served"] == 16 and end["generated"] == end["served"] + end["dropped"] + end["left_in_queue"]


@pytest.fixture(scope="module")
def rollout(tiny_model, ray_cluster):
    """(config, two rollout workers, prompts): workers report progress for a stall timeout of STALL_S."""
    from transformers import AutoTokenizer

    from actors.rollout import RolloutWorker
    from mugrpo_async.data.pool import load_prompts
    from mugrpo_async.rollout.engine import engine_env
    from tests.conftest import tiny_config

    cfg = tiny_config(tiny_model, overrides=[f"rollout.stall_timeout_s={STALL_S}", "rollout.max_restarts=1",
                                             "data.num_problems=64"])  # fmt: skip
    workers = [RolloutWorker.options(num_cpus=1, runtime_env={"env_vars": engine_env(cfg)}, max_restarts=1,
                                     max_task_retries=0).remote(cfg.to_dict(), i) for i in range(2)]  # fmt: skip
    prompts, _ = load_prompts(cfg, AutoTokenizer.from_pretrained(cfg.model.path))
    ray_cluster.get([w.info.remote() for w in workers])
    yield cfg, workers, prompts
    for w in workers:
        ray_cluster.kill(w)


@pytest.mark.slow
def test_an_evaluation_spread_over_two_workers_gives_the_records_of_one(rollout, ray_cluster):
    from drivers.rollout_pool import RolloutPool
    from mugrpo_async.evaluation.benchmarks import summarize

    cfg, workers, problems = rollout
    greedy = {"n": 1, "temperature": 0.0, "max_new_tokens": 16}
    requests = {"heldout": {**greedy, "prompts": problems[:18]}, "gsm8k": {**greedy, "prompts": problems[18:30]}}
    one = {name: ray_cluster.get(workers[0].evaluate.remote(r["prompts"], 1, 0.0, 16)) for name, r in requests.items()}
    shares = split_eval(requests, 2)
    assert len(shares) == 2 and all(set(s) == {"heldout", "gsm8k"} for s in shares)
    results, faults = RolloutPool(cfg, workers).evaluate(shares)
    assert faults == {"worker_failures": 0, "timeouts": 0, "retries": 0}
    assert all(len(res["heldout"]) + len(res["gsm8k"]) == 15 for res in results)  # both workers took part
    merged = merge_eval(requests, shares, results)
    assert merged == one
    assert [summarize(n, merged[n], [1], 0) for n in requests] == [summarize(n, one[n], [1], 0) for n in requests]


@pytest.mark.slow
def test_a_long_call_that_keeps_generating_is_not_killed(rollout, ray_cluster):
    from drivers.rollout_pool import RolloutPool

    cfg, workers, prompts = rollout
    worker = workers[1]
    ray_cluster.get(worker.__ray_call__.remote(_slow_steps(0.4)))  # a token every 0.4 s, for 11+ steps
    try:
        got = {}
        faults = RolloutPool(cfg, [worker]).generate({0: prompts[:4]}, got.__setitem__)
    finally:
        ray_cluster.get(worker.__ray_call__.remote(_plain_steps))
    assert faults == {"worker_failures": 0, "timeouts": 0, "retries": 0}
    assert got[0]["t_generate_s"] > STALL_S  # the call lasted longer than the stall timeout, untouched
    assert [g.prompt_id for g in got[0]["groups"]] == [p["prompt_id"] for p in prompts[:4]]


@pytest.mark.slow
def test_a_worker_whose_engine_stops_making_progress_is_restarted_and_its_chunk_generated_again(rollout, ray_cluster):
    from drivers.rollout_pool import RolloutPool

    cfg, workers, prompts = rollout
    worker = workers[0]
    pool = RolloutPool(cfg, [worker])
    # The engine generates for two steps (progress), then hangs in its third: the call raises nothing and
    # would never end; only its silence tells.
    ray_cluster.get(worker.__ray_call__.remote(_stalls_after(2)))
    got: dict[int, list] = {}
    faults = pool.generate({0: prompts[:4], 1: prompts[4:8]}, lambda c, out: got.setdefault(c, []).append(out))
    assert faults == {"worker_failures": 1, "timeouts": 1, "retries": 0} and pool.restarts == 1
    assert sorted(got) == [0, 1] and [len(v) for v in got.values()] == [1, 1]  # each chunk accepted once
    assert [g.prompt_id for c in (0, 1) for g in got[c][0]["groups"]] == [p["prompt_id"] for p in prompts[:8]]
