"""The rollout worker's reward path on the real Ray: warm scorer actors behind a memo of scored pairs."""

from __future__ import annotations

import pytest

from mugrpo_async.config import RewardConfig
from mugrpo_async.rewards.boxed_math import score_batch

pytestmark = pytest.mark.slow


def test_memo_scores_each_pair_once_across_scorers_and_matches_score_batch(ray_cluster):
    from actors.reward import RewardMemo, RewardScorer

    scorers = [RewardScorer.remote() for _ in range(2)]
    memo = RewardMemo(RewardConfig(timeout_s=5.0), scorers)
    memo.BATCH = 2  # several calls, so that both scorers get some
    texts = [["\\boxed{3}", "\\boxed{3}", "no box", "\\boxed{6/2}"], ["\\boxed{1/2}", "\\boxed{0.5}", "x", "x"]]
    answers = ["3", "0.5"]
    for group, answer in zip(texts, answers):
        memo.submit(group, answer)  # as groups finish during generation
    calls = len(memo.sent)
    rewards, failures = memo.collect(texts, answers)
    want = [score_batch(g, [a] * len(g))[0] for g, a in zip(texts, answers)]
    assert rewards == want == [[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]] and failures == 0
    assert calls >= 2 and len(memo.known) == 6  # 8 responses, 6 distinct pairs, each scored once
    for group, answer in zip(texts, answers):
        memo.submit(group, answer)
    assert not memo.waiting and not memo.sent  # everything known: nothing goes to a scorer
    assert memo.collect(texts, answers) == (rewards, 0)
