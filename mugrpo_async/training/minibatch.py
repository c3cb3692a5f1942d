"""One update's minibatch as one trainer rank sees it: its share of the rows, the minibatch-wide totals, the
micro-batches, and the pieces of minibatch-wide masks that belong to them. Pure torch, no Ray.

Every rank receives the same B_mini groups; rank r takes the r-th contiguous block of the B_mini * G (group,
response) rows, cut into micro-batches of ``trainer.micro_batch_size`` rows. With a token budget
(``trainer.max_tokens_per_micro_batch``) the rows are instead spread over the ranks so that their tokens balance,
and each rank packs its length-ordered rows into micro-batches of at most that many padded tokens (rows x longest
row); every rank computes every rank's packing from the same minibatch, so all run the same number of
micro-batches (splitting or padding their own) and DeepSpeed's per-backward collectives stay paired. Each
micro-batch's loss is normalised by the whole minibatch's totals (N responses, sum_i T_i
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
        truncated_masked: responses of the minibatch (all ranks) masked out as cut at the length limit.
        num_micro: with a token budget, the micro-batches every rank runs (the most any rank's packing needs);
            else 0.
    """

    batch: Batch
    totals: dict[str, int]
    groups_dropped: int
    truncated_masked: int = 0
    num_micro: int = 0


def rank_rows(groups: list[Group], rank: int, world_size: int) -> list[Row]:
    """Rank ``rank``'s contiguous share of the minibatch's rows, ordered by length (micro-batches pad less).

    The row count B_mini * G must be a multiple of ``world_size`` (the config checks it).
    """
    rows = flatten(groups)
    if len(rows) % world_size:
        raise ValueError(f"{len(rows)} rows do not split evenly over {world_size} ranks")
    per = len(rows) // world_size
    return by_length(rows[rank * per : (rank + 1) * per])


def _row_len(row: Row) -> int:
    return len(row[0].prompt_ids) + len(row[0].responses[row[1]])


def balanced_rank_rows(groups: list[Group], world_size: int) -> list[list[Row]]:
    """Every rank's rows, ordered by length, with prompt + response tokens balanced over the ranks.

    Longest row first, each to the rank holding the fewest tokens so far (the LPT rule; ties to the lower rank):
    no rank exceeds the mean by more than one row's length. Deterministic, so every rank computes the same split.
    """
    rows = sorted(flatten(groups), key=_row_len, reverse=True)
    shares: list[list[Row]] = [[] for _ in range(world_size)]
    tokens = [0] * world_size
    for row in rows:
        r = min(range(world_size), key=lambda k: (tokens[k], k))
        shares[r].append(row)
        tokens[r] += _row_len(row)
    return [by_length(s) for s in shares]


def token_bounds(lengths: list[int], budget: int, packed: bool = False) -> list[tuple[int, int]]:
    """(start, stop) slices of ``lengths`` (ascending) with (stop - start) * lengths[stop - 1] <= ``budget``, or,
    ``packed`` (padding-free micro-batches), sum(lengths[start:stop]) <= ``budget``.

    Greedy: a micro-batch takes rows while its size (padded: rows x its longest row; packed: its rows' tokens)
    stays within the budget; a row longer than the budget forms a micro-batch of its own.
    """
    bounds, start, total = [], 0, 0
    for k, n in enumerate(lengths):
        total += n
        if k > start and (total if packed else (k + 1 - start) * n) > budget:
            bounds.append((start, k))
            start, total = k, n
    if lengths:
        bounds.append((start, len(lengths)))
    return bounds


def equalise(bounds: list[tuple[int, int]], lengths: list[int], count: int) -> list[tuple[int, int]]:
    """``bounds`` brought to ``count`` micro-batches: the one with the most padded tokens split in two (rows
    ordered as before) while one has two rows or more; then empty ``(0, 0)`` slices (padding micro-batches)."""
    bounds = list(bounds)
    while len(bounds) < count:
        k = max(range(len(bounds)), key=lambda i: (bounds[i][1] - bounds[i][0]) * lengths[bounds[i][1] - 1])
        a, b = bounds[k]
        if b - a < 2:
            break
        bounds[k : k + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    return bounds + [(0, 0)] * (count - len(bounds))


def rank_share(
    groups: list[Group],
    rank: int,
    world_size: int,
    drop_equal_reward_groups: bool,
    trainer_logprobs: list | None = None,
    mask_truncated: bool = False,
    max_tokens: int = 0,
    packed: bool = False,
) -> RankShare:
    """This rank's padded rows and the minibatch totals, after the optional equal-reward drop.

    A group whose rewards are all equal has advantages of exactly 0 and adds nothing to the surrogate; with
    ``drop_equal_reward_groups`` it is also left out of N and sum_i T_i (so the other groups weigh more).
    ``trainer_logprobs``: per group, the trainer's behaviour log-probs of each response (truncated importance
    sampling), carried into the batch's ``trainer_behavior_logprobs``. ``mask_truncated`` (``algo.overlong:
    mask``): responses whose finish reason is ``length`` are masked out and left out of the totals likewise.
    ``max_tokens``: the token budget of a micro-batch (0: off, contiguous row shares); ``packed``: counted as the
    rows' tokens (padding-free micro-batches), else as rows x longest row.
    """
    num_micro = 0
    if max_tokens:
        shares = balanced_rank_rows(groups, world_size)
        mine = shares[rank]
        num_micro = max(len(token_bounds([_row_len(r) for r in s], max_tokens, packed)) for s in shares)
    else:
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
    n_rows = len(rows)
    if mask_truncated:
        rows = [(g, i) for g, i in rows if g.finish_reasons[i] != "length"]
        batch.response_mask &= torch.tensor([g.finish_reasons[i] != "length" for g, i in mine]).unsqueeze(1)
    totals = {"num_sequences": max(len(rows), 1), "num_tokens": sum(len(g.responses[i]) for g, i in rows)}
    return RankShare(batch, totals, len(groups) - len(live), n_rows - len(rows), num_micro)


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """Consecutive slices of at most ``size`` rows, each trimmed to its own longest sequence."""
    return [batch.slice(s, min(s + size, len(batch))) for s in range(0, len(batch), size)]


def token_micro_batches(batch: Batch, budget: int, count: int, packed: bool = False) -> list[Batch]:
    """``count`` micro-batches of the length-ordered ``batch`` cut by :func:`token_bounds` (``packed`` as there)
    and :func:`equalise`; a padding micro-batch is row 0 with no response token (no loss, no gradient, the same
    collectives)."""
    lengths = batch.attention_mask.sum(1).tolist()
    out = []
    for a, b in equalise(token_bounds(lengths, budget, packed), lengths, count):
        mb = batch.slice(a, b) if b > a else batch.slice(0, 1)
        if b == a:
            mb.response_mask = torch.zeros_like(mb.response_mask)
        out.append(mb)
    return out


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
