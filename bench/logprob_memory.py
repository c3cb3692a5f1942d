"""Log-prob peak memory and time: chunked against unchunked, forward + backward, one long row, a 152k vocabulary.

Each variant runs in a fresh subprocess (``--variant``): the model is only what differs between the paths, an
output head of V = 151,936 x H = 64 over the hidden states of one row (prompt of 1 token + ``--tokens``
response tokens), behind the causal-LM interface the trainer calls (``base_model``, ``get_output_embeddings``,
``forward(...).logits``). Peak = the process's peak RSS (``ru_maxrss``) minus its RSS once inputs and weights
exist; time = the fastest of ``--repeats`` forward + backward passes. Variants: ``today``
(`batching.token_logprobs`, the path before chunking), ``unchunked`` (`logprobs.token_scores` with chunk 0,
entropies included), ``chunk-N`` (`logprobs.token_scores` with N positions per chunk).

    .venv/bin/python -m bench.logprob_memory --tokens 4096 --variants today unchunked chunk-1024 chunk-512
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from types import SimpleNamespace

VOCAB, HIDDEN = 151_936, 64


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _model(torch):
    """An output head over fixed hidden states, behind the causal-LM calls the trainer makes."""

    class HeadOnly(torch.nn.Module):
        def __init__(self, hidden: torch.Tensor):
            super().__init__()
            self.hidden = torch.nn.Parameter(hidden)  # (1, S, H): stands for the transformer's output
            self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
            self.config = SimpleNamespace()
            self.base_model = lambda **kw: SimpleNamespace(last_hidden_state=self.hidden)

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, input_ids, attention_mask):
            return SimpleNamespace(logits=self.lm_head(self.hidden))

    return HeadOnly


def run_variant(variant: str, tokens: int, repeats: int) -> dict:
    import torch

    from mugrpo_async.rollout.samples import Group
    from mugrpo_async.training.batching import collate, flatten, token_logprobs
    from mugrpo_async.training.logprobs import token_scores

    torch.manual_seed(0)
    torch.set_num_threads(2)
    g = Group(prompt_id="p", prompt_ids=[1], answer="0", responses=[torch.randint(0, VOCAB, (tokens,)).tolist()],
              behavior_logprobs=[[-1.0] * tokens], rewards=[0.0], advantages=[0.0], policy_version=0,
              finish_reasons=["stop"])  # fmt: skip
    batch = collate(flatten([g]), pad_id=0)
    model = _model(torch)(torch.randn(1, tokens + 1, HIDDEN) * 0.5)
    weights = torch.randn(1, tokens)
    base = _rss_bytes()
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if variant == "today":
            logp = token_logprobs(model, batch)
        else:
            chunk = 0 if variant == "unchunked" else int(variant.split("-")[1])
            logp, _ = token_scores(model, batch, 1.0, chunk)
        (logp * weights).sum().backward()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grad = float(model.hidden.grad.norm())
    return {"variant": variant, "tokens": tokens, "peak_bytes": peak - base, "time_s": min(times), "grad_norm": grad}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["today", "unchunked", "chunk-1024"])
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.variant:
        print(json.dumps(run_variant(a.variant, a.tokens, a.repeats)))
        return
    rows = []
    for v in a.variants:
        cmd = [sys.executable, "-m", "bench.logprob_memory", "--variant", v, "--tokens", str(a.tokens),
               "--repeats", str(a.repeats)]  # fmt: skip
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    ref = rows[0]
    print(f"| variant | tokens | peak (GiB) | peak vs {ref['variant']} | time (s) | time vs {ref['variant']} |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['tokens']} | {r['peak_bytes'] / 2**30:.2f} | "
              f"{ref['peak_bytes'] / max(r['peak_bytes'], 1):.1f}x less | {r['time_s']:.2f} | "
              f"{r['time_s'] / ref['time_s'] - 1:+.0%} |")  # fmt: skip
    assert len({round(r["grad_norm"], 2) for r in rows}) == 1, [r["grad_norm"] for r in rows]


if __name__ == "__main__":
    main()
