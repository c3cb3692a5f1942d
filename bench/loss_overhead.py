"""Cost of the mu-GRPO policy loss against a minimal clipped GRPO loss, forward + backward.

Both losses see the same tensors: B = 256 responses x T = 4096 tokens, float32, behaviour log-probs of a
sampled policy, current log-probs drifted from them (a small Gaussian drift plus rare large drops, which
trigger the veto), about 30 % right padding, group-normalised advantages of G = 8. mu-GRPO settings: clip
[0, 5], NAV scope `sequence`, tau 1e-4, metrics included. Baseline: clip [0.8, 1.2], no veto, no metrics,
written inline below. The two are timed alternately, so both see the same load on a shared machine;
prints the median times, the median of the per-repeat ratios, and one markdown table row.

    .venv/bin/python bench/loss_overhead.py [--device cuda] [--repeats 15] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from mugrpo_async.algo import group_advantages, policy_loss

MU_GRPO = {"clip_low": 0.0, "clip_high": 5.0, "nav_tau": 1e-4, "nav_scope": "sequence"}


def make_inputs(B: int, T: int, G: int, device: str, seed: int = 0):
    """Synthetic (l, b, A, mask): l, b (B, T) float32, A (B,), mask (B, T) bool."""
    g = torch.Generator().manual_seed(seed)
    b = -torch.empty(B, T).exponential_(2.0, generator=g)  # log-probs of sampled tokens, mean -0.5
    l = b + 0.05 * torch.randn(B, T, generator=g)
    drops = torch.rand(B, T, generator=g) < 2e-5  # rare tokens the current policy has abandoned
    l = torch.where(drops, b - 12.0, l)
    lengths = torch.randint(int(0.4 * T), T + 1, (B,), generator=g)  # mean 0.7 T: ~30 % padding
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rewards = (torch.rand(B // G, G, generator=g) < 0.5).float()
    A = group_advantages(rewards).flatten()
    return l.to(device), b.to(device), A.to(device), mask.to(device)


def grpo_baseline(l: torch.Tensor, b: torch.Tensor, A: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Plain clipped GRPO, seq-mean-token-mean: -(1/N) sum_i (1/T_i) sum_t min(rho A, clip(rho) A)."""
    rho = torch.exp(l - b)
    a = A[:, None]
    s = torch.minimum(rho * a, rho.clamp(0.8, 1.2) * a)
    return -((s * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


def timed_ms(step: Callable[[], None], device: str) -> float:
    """Wall time of one step() in milliseconds."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    l, b, A, mask = make_inputs(args.batch, args.length, 8, args.device)
    logp = l.clone().requires_grad_()
    metrics = {}

    def baseline_step() -> None:
        logp.grad = None
        grpo_baseline(logp, b, A, mask).backward()

    def mu_step() -> None:
        logp.grad = None
        loss, m = policy_loss(logp, b, A, mask, **MU_GRPO)
        loss.backward()
        metrics.update(m)

    pairs = []  # (baseline ms, mu-GRPO ms), one per repeat, timed back to back
    for _ in range(args.repeats + 2):
        pairs.append((timed_ms(baseline_step, args.device), timed_ms(mu_step, args.device)))
    pairs = pairs[2:]  # warm-up
    t_base, t_mu = (statistics.median(p[k] for p in pairs) for k in (0, 1))
    ratio = statistics.median(mu / base for base, mu in pairs)
    threads = torch.get_num_threads() if args.device == "cpu" else "-"
    print(f"padding {1 - mask.float().mean().item():.1%}, nav_veto_frac {metrics['nav_veto_frac']:.3f}, "
          f"clip_frac {metrics['clip_frac']:.4f}, ratio_ess {metrics['ratio_ess']:.4f}")  # fmt: skip
    print(f"GRPO baseline {t_base:.1f} ms, mu-GRPO policy_loss {t_mu:.1f} ms (medians of {args.repeats})")
    print(f"overhead (median of per-repeat ratios): x{ratio:.2f}")
    print("| device | threads | B x T | GRPO baseline (ms) | mu-GRPO policy_loss (ms) | overhead |")
    print("|---|---|---|---|---|---|")
    shape = f"{args.batch} x {args.length}"
    print(f"| {args.device} | {threads} | {shape} | {t_base:.1f} | {t_mu:.1f} | x{ratio:.2f} |")


if __name__ == "__main__":
    main()
