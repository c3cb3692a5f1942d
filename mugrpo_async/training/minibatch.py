"""One update's minibatch as one trainer rank sees it: its share of the rows, the minibatch-wide totals, the
micro-batches, and the pieces of minibatch-wide masks that belong to them. Pure torch, no Ray.

Every rank receives the same B_mini groups; rank r takes the r-th contiguous block of the B_mini * G (group,
response) rows. Each micro-batch's loss is normalised by the whole minibatch's totals (N responses, sum_i T_i
tokens), so the gradients of all micro-batches of all ranks sum to that of one pass over the minibatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mugrpo_async.algo import m2po_mask, nonconstant_groups
from mugrpo_async.rollout.samples import Group
from mugrpo_async.training.batching import Batch, by_length, collate, flatten

Row = tuple[Group, int]  # (group, response index)


@dataclass
class RankShare:
    """This rank's part of one minibatch.

    Attributes:
        batch: this rank's rows (ordered by length), padded; rows of dropped groups have an all-False
            response mask, so they add nothing to the loss.
        totals: ``{"num_sequences": N, "num_tokens": sum_i T_i}`` over the minibatch's kept rows (all ranks).
        groups_dropped: groups of the minibatch dropped for equal rewards.
    """

    batch: Batch
    totals: dict[str, int]
    groups_dropped: int


def rank_rows(groups: list[Group], rank: int, world_size: int) -> list[Row]:
    """Rank ``rank``'s contiguous share of the minibatch's rows, ordered by length (micro-batches pad less).

    The row count B_mini * G must be a multiple of ``world_size`` (the config checks it).
    """
    rows = flatten(groups)
    if len(rows) % world_size:
        raise ValueError(f"{len(rows)} rows do not split evenly over {world_size} ranks")
    per = len(rows) // world_size
    return by_length(rows[rank * per : (rank + 1) * per])


def rank_share(
    groups: list[Group],
    rank: int,
    world_size: int,
    drop_equal_reward_groups: bool,
    trainer_logprobs: list | None = None,
) -> RankShare:
    """This rank's padded rows and the minibatch totals, after the optional equal-reward drop.

    A group whose rewards are all equal has advantages of exactly 0 and adds nothing to the surrogate; with
    ``drop_equal_reward_groups`` it is also left out of N and sum_i T_i (so the other groups weigh more).
    ``trainer_logprobs``: per group, the trainer's behaviour log-probs of each response (truncated importance
    sampling), carried into the batch's ``trainer_behavior_logprobs``.
    """
    mine = rank_rows(groups, rank, world_size)
    rows_lps = None
    if trainer_logprobs is not None:
        of = {id(g): lps for g, lps in zip(groups, trainer_logprobs)}
        rows_lps = [of[id(g)][i] for g, i in mine]
    batch = collate(mine, pad_id=0, row_logprobs=rows_lps)
    live = list(groups)
    if drop_equal_reward_groups and groups:
        signal = nonconstant_groups(torch.tensor([g.rewards for g in groups])).tolist()
        live = [g for g, s in zip(groups, signal) if s]
        kept = {id(g) for g in live}
        batch.response_mask &= torch.tensor([id(g) in kept for g, _ in mine], dtype=torch.bool).unsqueeze(1)
    rows = flatten(live)
    totals = {"num_sequences": max(len(rows), 1), "num_tokens": sum(len(g.responses[i]) for g, i in rows)}
    return RankShare(batch, totals, len(groups) - len(live))


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """Consecutive slices of at most ``size`` rows, each trimmed to its own longest sequence."""
    return [batch.slice(s, min(s + size, len(batch))) for s in range(0, len(batch), size)]


def token_log_ratios(logprobs: torch.Tensor, mb: Batch) -> torch.Tensor:
    """(n,) log rho = l - base of the micro-batch's response tokens (row-major); base: the trainer's behaviour
    log-probs when the batch carries them (truncated importance sampling), else the engine's."""
    base = mb.behavior_logprobs if mb.trainer_behavior_logprobs is None else mb.trainer_behavior_logprobs
    return (logprobs - base)[mb.response_mask]


def m2po_micro_keeps(
    log_ratios: list[torch.Tensor], micro: list[Batch], all_ranks: list[torch.Tensor], rank: int, threshold: float
) -> list[torch.Tensor]:
    """M2PO's minibatch-wide keep-mask, cut back into this rank's micro-batches.

    Args:
        log_ratios: per micro-batch, the (n_k,) log ratios of its response tokens (row-major order).
        micro: this rank's micro-batches (their response masks place the tokens).
        all_ranks: per rank, the concatenation of that rank's ``log_ratios`` (this rank's at index ``rank``).
        rank: this rank's index.
        threshold: tau_M2.

    Returns:
        Per micro-batch, a (B_k, T_k) bool keep-mask: `m2po_mask` over every response token of the minibatch,
        the same tokens one pass over the whole minibatch would see.
    """
    everything = torch.cat(all_ranks).view(1, -1)  # (1, n) every response token of the minibatch
    keep = m2po_mask(everything, torch.ones_like(everything, dtype=torch.bool), threshold)[0]
    start = sum(len(p) for p in all_ranks[:rank])
    out = []
    for mb, r in zip(micro, log_ratios):
        k = torch.zeros_like(mb.response_mask)
        k[mb.response_mask] = keep[start : start + len(r)]
        start += len(r)
        out.append(k)
    return out
