"""The trainer's token log-probs and entropies, in chunks of positions so that no whole row's logits are held.

Shapes: N rows, S = max prompt+response length, T = max response length, n response tokens of the batch,
H hidden size, V vocabulary, c = ``chunk_tokens``.

Unchunked (``chunk_tokens == 0``), the model's full logits (N, S, V) are computed, the response positions
gathered and a float32 log-softmax taken over (N, T, V) at once: at T = 8k and V = 152k every float32 copy is
5 GB, and forward plus backward keep several alive. Chunked, only the hidden states (n, H) of the response
positions are kept; the output head runs on c positions at a time, and each chunk's float32 logits (c, V) are
dropped as soon as its log-probs, entropies and log-sum-exps are taken. Backward recomputes one chunk's logits
at a time from the saved hidden states and log-sum-exps (:class:`ChunkedHeadLogprobs`), so the peak is one
chunk's logits in forward and in backward alike. The gradient is the unchunked one (same formula, summed over
chunks); under ZeRO-3, whose output head is partitioned outside its own forward, each chunk runs the head module
under non-reentrant activation checkpointing instead (the same values, a log-softmax recomputed in backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mugrpo_async.training.batching import Batch, packed_inputs, response_logits


def token_scores(
    model: torch.nn.Module, batch: Batch, temperature: float = 1.0, chunk_tokens: int = 0, packed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies), each (N, T) float32, 0 on padding, under pi = softmax(logits / temperature).

    The log-probs carry the graph; the entropies H_t = -sum_v pi_v log pi_v (the sampling distribution's, per
    response token) do not. ``model``: a causal LM or an engine wrapping one as ``module`` (DeepSpeed's).
    ``chunk_tokens``: response positions per chunk of the output head (0: the whole batch at once). ``packed``:
    the forward runs on the rows packed into one sequence without padding (`batching.packed_inputs`).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens <= 0:
        return _unchunked(model, batch, temperature, packed)
    lm = getattr(model, "module", model)
    head = _output_head(lm)
    h = _response_hidden(lm, batch, packed)  # (n, H)
    targets = batch.input_ids.gather(1, batch.response_index)[batch.response_mask]  # (n,)
    if hasattr(head.weight, "ds_id"):  # a ZeRO-3 partitioned parameter: only the module's forward gathers it
        logp, ent = _checkpointed(head, h, targets, temperature, chunk_tokens)
    else:
        logp, ent = ChunkedHeadLogprobs.apply(h, head.weight, head.bias, targets, temperature, chunk_tokens)
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=h.device)
    return out.masked_scatter(batch.response_mask, logp), out.masked_scatter(batch.response_mask, ent.detach())


def _response_hidden(lm: torch.nn.Module, batch: Batch, packed: bool) -> torch.Tensor:
    """(n, H) the last hidden states that predict the batch's n response tokens (row-major)."""
    if packed:
        inputs, pos = packed_inputs(batch)
        return lm.base_model(**inputs, use_cache=False).last_hidden_state[0][pos[batch.response_mask]]
    hidden = lm.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    pos = (batch.response_index - 1).clamp(min=0)[batch.response_mask]  # (n,) position predicting each token
    rows = batch.response_mask.nonzero()[:, 0]  # (n,)
    return hidden.last_hidden_state[rows, pos]


def _unchunked(model: torch.nn.Module, batch: Batch, temperature: float, packed: bool = False):
    """The whole batch's logits at once (the model's forward), gathered at the response positions."""
    z, target = response_logits(model, batch, temperature, packed)  # (N, T, V), (N, T)
    lse = torch.logsumexp(z, dim=-1)  # (N, T)
    logp = z.gather(-1, target.unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    pad = ~batch.response_mask
    return logp.masked_fill(pad, 0.0), ent.masked_fill(pad, 0.0)


def _output_head(lm: torch.nn.Module) -> torch.nn.Linear:
    """The causal LM's output head, checked to be a plain linear map of the last hidden state."""
    head = lm.get_output_embeddings()
    config = getattr(lm, "config", None)
    scaled = any(getattr(config, k, None) for k in ("final_logit_softcapping", "logit_scale"))
    if not isinstance(head, torch.nn.Linear) or scaled:
        raise ValueError(
            f"trainer.logprob_chunk_tokens: {type(lm).__name__}'s logits are not a plain linear head of its last "
            "hidden state (soft-capped or scaled); set trainer.logprob_chunk_tokens=0"
        )
    return head


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float):
    """(c, V) float32 logits / temperature of c hidden states (c, H) (one fresh tensor, divided in place)."""
    z = F.linear(h, weight, bias).float()
    return z.div_(temperature) if temperature != 1.0 else z


class ChunkedHeadLogprobs(torch.autograd.Function):
    """log pi(target) and the entropy of pi = softmax((h W^T + b) / temperature), chunk by chunk over positions.

    Forward: hidden (n, H), weight (V, H), bias (V,) or None, targets (n,) int64 -> logp (n,), entropy (n,) (not
    differentiable), both float32. Saves h, the weight and the (n,) log-sum-exps; backward recomputes a chunk's
    logits z and uses d logp_t / d z_t = (onehot(target_t) - softmax(z_t)) / temperature.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int):
        n = hidden.shape[0]
        logp, ent, lse = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(3))
        for s in range(0, n, chunk):
            z = _chunk_logits(hidden[s : s + chunk], weight, bias, temperature)  # (c, V)
            lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
            logp[s : s + chunk] = z.gather(-1, targets[s : s + chunk, None])[:, 0] - lse[s : s + chunk]
            z.sub_(lse[s : s + chunk, None])  # z is now log pi
            ent[s : s + chunk] = -(z.exp() * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, _g_ent):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_h = torch.empty_like(hidden) if need_h else None
        g_w = torch.zeros_like(weight) if need_w else None
        g_b = torch.zeros_like(bias) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            h, g = hidden[s : s + chunk], g_logp[s : s + chunk, None]  # (c, H), (c, 1)
            gz = _chunk_logits(h, weight, bias, t).sub_(lse[s : s + chunk, None]).exp_().mul_(-g)  # -pi * g
            gz.scatter_add_(-1, targets[s : s + chunk, None], g).div_(t)  # (onehot - pi) * g / T, (c, V)
            gz = gz.to(weight.dtype)
            if need_h:
                g_h[s : s + chunk] = gz @ weight
            if need_w:
                g_w.addmm_(gz.t(), h)
            if need_b:
                g_b += gz.sum(0)
        return g_h, g_w, g_b, None, None, None


def _checkpointed(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int):
    """:class:`ChunkedHeadLogprobs`'s outputs through the head module, each chunk under activation checkpointing."""

    def scores(h_c: torch.Tensor, t_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logpi = torch.log_softmax(head(h_c).float() / temperature, dim=-1)  # (c, V)
        with torch.no_grad():
            ent = -(logpi.exp() * logpi).sum(-1)
        return logpi.gather(-1, t_c[:, None])[:, 0], ent

    parts = [checkpoint(scores, h[s : s + chunk], targets[s : s + chunk], use_reentrant=False)
             for s in range(0, h.shape[0], chunk)]  # fmt: skip
    return torch.cat([p for p, _ in parts]), torch.cat([e for _, e in parts])
