"""The rollout worker's reward path on the real Ray: warm scorer actors behind a memo of scored pairs, and what
happens when a scorer blocks where math-verify's alarm cannot reach it, or dies."""

from __future__ import annotations

import os
import signal
import time

import pytest

from mugrpo_async.config import RewardConfig
from mugrpo_async.rewards.boxed_math import score_batch
from tests.conftest import tiny_config

pytestmark = pytest.mark.slow

STUCK = "\\boxed{1E+100000000}"
"""Blocks math-verify 0.9 in C: sympy's Float parsing converts a 10^8-digit Decimal to int (minutes, ~100 MB)."""


def _pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def test_memo_scores_each_pair_once_across_scorers_and_matches_score_batch(ray_cluster):
    from actors.reward import RewardMemo, RewardScorer

    scorers = [RewardScorer.remote() for _ in range(2)]
    memo = RewardMemo(RewardConfig(timeout_s=5.0), scorers, batch_size=2)  # several calls, both scorers get some
    texts = [["\\boxed{3}", "\\boxed{3}", "no box", "\\boxed{6/2}"], ["\\boxed{1/2}", "\\boxed{0.5}", "x", "x"]]
    answers = ["3", "0.5"]
    for group, answer in zip(texts, answers):
        memo.submit(group, answer)  # as groups finish during generation
    calls = len(memo.streams)
    rewards, failures = memo.collect(texts, answers)
    want = [score_batch(g, [a] * len(g))[0] for g, a in zip(texts, answers)]
    assert rewards == want == [[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]] and failures == 0
    assert calls == 2 and len(memo.book.known) == 6  # 8 responses, 6 distinct pairs, each scored once
    for group, answer in zip(texts, answers):
        memo.submit(group, answer)
    assert not memo.book.waiting and not memo.streams  # everything known: nothing goes to a scorer
    assert memo.collect(texts, answers) == (rewards, 0)


def test_stuck_scorer_is_killed_and_restarted_and_the_worker_never_scores(ray_cluster, monkeypatch, caplog):
    from actors.reward import RewardMemo, RewardScorer
    from mugrpo_async.rewards import boxed_math

    def never(*args, **kwargs):
        raise AssertionError("the worker's process scored an answer itself")

    monkeypatch.setattr(boxed_math, "_score_one", never)  # this process plays the worker; scorers are others
    scorer = RewardScorer.remote()
    memo = RewardMemo(RewardConfig(timeout_s=1.0), [scorer])  # deadline: 1 s alarm + 2 s grace per pair
    memo.warm_up()
    pid = _pid(scorer)
    texts = [["\\boxed{1/2}", STUCK, "\\boxed{0.5}", "\\boxed{2/3}"], ["\\boxed{7}", "\\boxed{3.5}"]]
    answers = ["0.5", "7/2"]
    memo.submit(texts[0], answers[0])  # while "generating": the scorer takes the batch and blocks on STUCK
    t0 = time.monotonic()
    rewards, failures = memo.collect(texts, answers)
    took = time.monotonic() - t0
    print(f"collect with a stuck answer: {took:.1f}s (deadline {memo.deadline_s:.0f}s)")
    assert rewards == [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0]] and failures == 1
    assert took < memo.deadline_s + 30  # the deadline, the restart, then the re-sent answers
    assert memo.restarts == 1 and (STUCK, "0.5") not in memo.book.known and "silent for 3s" in caplog.text
    new_pid = _pid(scorer)
    assert new_pid != pid
    later = [["\\boxed{1/4}", "\\boxed{0.25}", "\\boxed{4}"]]
    assert memo.collect(later, ["0.25"]) == ([[1.0, 1.0, 0.0]], 0)  # the restarted scorer scores later batches
    assert _pid(scorer) == new_pid and memo.restarts == 1


def test_scorer_killed_mid_batch_is_restarted_and_its_answers_rescored(ray_cluster, caplog):
    import ray

    from actors.reward import RewardMemo, RewardScorer

    scorer = RewardScorer.remote()
    texts = [[f"\\boxed{{{k}/{k + 1}}}" for k in range(j, j + 8)] for j in range(1, 1601, 8)]  # ~2.6 ms each
    answers = [f"{j}/{j + 1}" for j in range(1, 1601, 8)]  # the first response of each group is right
    memo = RewardMemo(RewardConfig(timeout_s=5.0), [scorer], batch_size=1600)  # one batch of all 1600 pairs
    memo.warm_up()
    pid = _pid(scorer)
    for group, answer in zip(texts, answers):
        memo.submit(group, answer)
    (stream,) = memo.streams.values()
    ready, _ = ray.wait([stream], timeout=60)  # the scorer is busy with the batch: kill its process
    assert ready
    os.kill(pid, signal.SIGKILL)
    rewards, failures = memo.collect(texts, answers)
    assert _pid(scorer) != pid and memo.restarts == 0  # Ray restarted it; the memo killed nothing
    assert "reward scorer 0 failed" in caplog.text  # the stream broke mid-batch and the rest was re-sent
    assert failures == 0 and rewards == [[1.0] + [0.0] * 7] * len(texts)


def test_rollout_worker_continues_after_its_scorer_dies(ray_cluster, tiny_model):
    from transformers import AutoTokenizer

    from actors.rollout import RolloutWorker, engine_env
    from mugrpo_async.data.pool import synthetic_prompts

    cfg = tiny_config(tiny_model)
    worker = RolloutWorker.options(num_cpus=1, runtime_env={"env_vars": engine_env(cfg)}).remote(cfg.to_dict(), 0)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompts = synthetic_prompts(cfg, tok)[0][:16]
    try:
        scorer = ray_cluster.get(worker.__ray_call__.remote(lambda w: w.rewards.scorers[0]))  # its handle
        pid = _pid(scorer)
        os.kill(pid, signal.SIGKILL)  # the worker's next batches go to a dead, then restarting, scorer
        out = ray_cluster.get(worker.generate.remote(prompts))
        assert _pid(scorer) != pid
    finally:
        ray_cluster.kill(worker)
    texts = [[tok.decode(r, skip_special_tokens=True) for r in g.responses] for g in out["groups"]]
    want = [score_batch(t, [g.answer] * len(t))[0] for t, g in zip(texts, out["groups"])]
    assert out["reward_failures"] == 0 and [g.rewards for g in out["groups"]] == want
    assert sum(map(sum, want)) > 0  # some right answers: the rewards are not all zeros by default
