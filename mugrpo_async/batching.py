"""Turning groups into padded tensors, and the trainer's log-prob computation.

Shapes: N responses, S = max prompt+response length, T = max response length, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mugrpo_async.samples import Group


@dataclass
class Batch:
    """Padded tensors of N responses (each with its prompt), ready for a forward pass.

    Attributes:
        input_ids: (N, S) prompt + response token ids, right-padded with ``pad_id``.
        attention_mask: (N, S) 1 on real tokens.
        response_index: (N, T) position in ``input_ids`` of each response token (0 on padding).
        response_mask: (N, T) bool, True on real response tokens.
        behavior_logprobs: (N, T) float32 engine log-probs of the sampled tokens (0 on padding).
        advantages: (N,) float32 per-response advantages A_i.
        rewards: (N,) float32 rewards R_i.
        policy_versions: (N,) int64 policy version that generated each response.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_index: torch.Tensor
    response_mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    policy_versions: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop`` (a micro-batch), trimmed to their own longest sequence."""
        rows = slice(start, stop)
        s = int(self.attention_mask[rows].sum(1).max()) if stop > start else 1
        t = int(self.response_mask[rows].sum(1).max()) if stop > start else 1
        return Batch(
            input_ids=self.input_ids[rows, :s],
            attention_mask=self.attention_mask[rows, :s],
            response_index=self.response_index[rows, :t],
            response_mask=self.response_mask[rows, :t],
            behavior_logprobs=self.behavior_logprobs[rows, :t],
            advantages=self.advantages[rows],
            rewards=self.rewards[rows],
            policy_versions=self.policy_versions[rows],
        )


def flatten(groups: list[Group]) -> list[tuple[Group, int]]:
    """(group, response index) pairs in group order: the row order of :func:`collate`."""
    return [(g, i) for g in groups for i in range(g.group_size)]


def collate(rows: list[tuple[Group, int]], pad_id: int) -> Batch:
    """Pad responses (with their prompts) into a :class:`Batch`; row k is ``rows[k]``."""
    n = len(rows)
    seqs = [g.prompt_ids + g.responses[i] for g, i in rows]
    s = max(1, max(len(x) for x in seqs))
    t = max(1, max(len(g.responses[i]) for g, i in rows))
    input_ids = torch.full((n, s), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, s), dtype=torch.long)
    response_index = torch.zeros((n, t), dtype=torch.long)
    response_mask = torch.zeros((n, t), dtype=torch.bool)
    behavior = torch.zeros((n, t), dtype=torch.float32)
    for k, ((g, i), seq) in enumerate(zip(rows, seqs)):
        p, r = len(g.prompt_ids), len(g.responses[i])
        input_ids[k, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[k, : len(seq)] = 1
        response_index[k, :r] = torch.arange(p, p + r)
        response_mask[k, :r] = True
        behavior[k, :r] = torch.tensor(g.behavior_logprobs[i], dtype=torch.float32)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_index=response_index,
        response_mask=response_mask,
        behavior_logprobs=behavior,
        advantages=torch.tensor([g.advantages[i] for g, i in rows], dtype=torch.float32),
        rewards=torch.tensor([g.rewards[i] for g, i in rows], dtype=torch.float32),
        policy_versions=torch.tensor([g.policy_version for g, _ in rows], dtype=torch.long),
    )


def token_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """log pi_theta(a_t | prompt, a_<t) of every response token, (N, T) float32, 0 on padding.

    The logit at position p predicts the token at p + 1, so response token j (at position
    ``response_index[:, j]``) is scored by the logits at ``response_index[:, j] - 1``. Only those
    rows of the logits are gathered before the float32 log-softmax, which keeps memory at
    O(N * T * V) instead of O(N * S * V).
    """
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (N, S, V)
    pos = (batch.response_index - 1).clamp(min=0)  # (N, T)
    picked = logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()  # (N, T, V)
    target = batch.input_ids.gather(1, batch.response_index)  # (N, T)
    logp = picked.gather(-1, target.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(picked, dim=-1)
    return logp.masked_fill(~batch.response_mask, 0.0)
