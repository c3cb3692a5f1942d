"""Updates per second: token-budget micro-batches against ``micro_batch_size`` rows, long-tailed lengths.

One process, the tiny model in plain PyTorch behind the engine interface (`PolicyUpdater` does the rest: shares,
packing, log-probs, loss, backward, one SGD step per update). Minibatch: 8 groups x 8 responses of the task's
prompts; response lengths long-tailed (85 % of 4-24 tokens, 15 % of 120-200). Each setting runs one warm-up
update and ``--updates`` timed ones on the same minibatch; the figure is updates / wall second. The budget of
one full context (prompt + 200 tokens) never holds more padded tokens than ``micro_batch_size: 1`` does.

    .venv/bin/python -m bench.token_budget --updates 5
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from bench.cluster import prompts, tiny_config


class PlainEngine(torch.nn.Module):
    """A model and optimizer behind the DeepSpeed engine calls the updater makes; steps at the boundary."""

    def __init__(self, model, opt):
        super().__init__()
        self.module, self.opt, self.boundary = model, opt, False

    def forward(self, **kw):
        return self.module(**kw)

    def set_gradient_accumulation_boundary(self, is_boundary: bool):
        self.boundary = is_boundary

    def backward(self, loss, scale_wrt_gas):
        loss.backward()

    def step(self):
        if self.boundary:
            self.opt.step()
            self.opt.zero_grad()

    def get_global_grad_norm(self):
        return 0.0


def long_tailed_groups(cfg, n_groups: int, seed: int = 0) -> list:
    """The task's prompts with random responses of long-tailed lengths and 0/1 rewards."""
    from mugrpo_async.algo import group_advantages
    from mugrpo_async.rollout.samples import Group

    rng = random.Random(seed)
    G, out = cfg.rollout.group_size, []
    for p in prompts(cfg)[:n_groups]:
        lengths = [rng.randint(120, 200) if rng.random() < 0.15 else rng.randint(4, 24) for _ in range(G)]
        resp = [[rng.randrange(2, 258) for _ in range(n)] for n in lengths]
        rewards = [float(rng.random() < 0.4) for _ in range(G)]
        adv = group_advantages(torch.tensor([rewards]))[0].tolist()
        lps = [[-rng.uniform(0.05, 3.0) for _ in r] for r in resp]
        out.append(Group(p["prompt_id"], p["prompt_ids"], p["answer"], resp, lps, rewards, adv, 0, ["stop"] * G))
    return out


def updates_per_s(overrides: list[str], groups: list, updates: int) -> tuple[float, float]:
    """(updates per second, micro-batches per update) of one setting."""
    from transformers import AutoModelForCausalLM

    from mugrpo_async.training.guard import NonFiniteGuard
    from mugrpo_async.training.update import PolicyUpdater

    cfg = tiny_config(["schedule.groups_per_update=8", "trainer.num_threads=2", *overrides])
    torch.set_num_threads(cfg.trainer_threads)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    updater = PolicyUpdater(PlainEngine(model, opt), cfg, 0, 1, NonFiniteGuard(opt))
    m = updater.update(groups)  # warm-up
    t0 = time.perf_counter()
    for _ in range(updates):
        updater.update(groups)
    return updates / (time.perf_counter() - t0), m["num_micro_batches"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=5)
    a = ap.parse_args()
    cfg = tiny_config()
    groups = long_tailed_groups(cfg, 8)
    context = max(len(g.prompt_ids) for g in groups) + 200
    settings = {
        "micro_batch_size 1": ["trainer.micro_batch_size=1"],
        "micro_batch_size 8": ["trainer.micro_batch_size=8"],
        f"max_tokens_per_micro_batch {context}": [f"trainer.max_tokens_per_micro_batch={context}"],
        f"max_tokens_per_micro_batch {4 * context}": [f"trainer.max_tokens_per_micro_batch={4 * context}"],
    }
    rows = {name: updates_per_s(o, groups, a.updates) for name, o in settings.items()}
    base = rows["micro_batch_size 1"][0]
    print("| micro-batches | passes per update | updates/s | vs micro_batch_size 1 |")
    print("|---|---|---|---|")
    for name, (ups, passes) in rows.items():
        print(f"| {name} | {passes} | {ups:.2f} | {ups / base:.1f}x |")


if __name__ == "__main__":
    main()
