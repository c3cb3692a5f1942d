"""Reward scoring in Ray tasks.

math-verify's timeouts rely on ``signal.alarm``, which works only in a process's main thread; a
Ray task runs there, so scoring happens in tasks (never in a threaded actor). The tasks take no
CPU reservation: the rollout worker that launches them blocks on their results, so the CPU it
reserved is the one they use.
"""

from __future__ import annotations

import logging

import ray

from mugrpo_async.config import RewardConfig

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_retries=1)
def score_chunk(responses: list[str], references: list[str], timeout_s: float) -> tuple[list[float], int]:
    """Score one chunk; returns (rewards, number of calls that timed out or raised)."""
    from mugrpo_async.reward import score_batch

    return score_batch(responses, references, timeout_s=timeout_s)


def score_groups(texts: list[list[str]], answers: list[str], cfg: RewardConfig) -> tuple[list[list[float]], int]:
    """Score every response of every group with ``cfg.num_tasks`` parallel tasks.

    Args:
        texts: per group, the G response texts.
        answers: per group, the reference answer.
        cfg: the reward config (timeout, parallelism).

    Returns:
        Per-group reward lists aligned with ``texts``, and the count of failed (0-scored) calls.
        A chunk whose task does not answer in time scores 0 for all its responses, counted.
    """
    flat = [(t, a) for group, a in zip(texts, answers) for t in group]
    if not flat:
        return [], 0
    size = -(-len(flat) // cfg.num_tasks)
    chunks = [flat[i : i + size] for i in range(0, len(flat), size)]
    refs = [score_chunk.remote([t for t, _ in c], [a for _, a in c], cfg.timeout_s) for c in chunks]
    rewards: list[float] = []
    failures = 0
    for ref, chunk in zip(refs, chunks):
        try:
            r, f = ray.get(ref, timeout=cfg.timeout_s * len(chunk) * 2 + 60)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError) as err:
            log.warning("reward chunk of %d responses failed (%s); scored 0", len(chunk), type(err).__name__)
            ray.cancel(ref, force=True)
            r, f = [0.0] * len(chunk), len(chunk)
        rewards.extend(r)
        failures += f
    out, k = [], 0
    for group in texts:
        out.append(rewards[k : k + len(group)])
        k += len(group)
    return out, failures
