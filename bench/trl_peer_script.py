"""TRL's GRPOTrainer on the project's tiny model and task: the peer of benchmark 6 (run in the bench venv).

Not a project module: it runs in ``.cache/bench-venv`` (TRL installed there, never a project
dependency), started by ``bench/trl_peer.py``. Same model folder, the same synthetic prompt pool
(``mugrpo_async.data.task`` with the training run's seed), G responses per prompt, B_mini groups per
update, one generation batch per ``mu`` updates, AdamW with the same settings, reward =
``mugrpo_async.rewards.boxed_math.boxed_reward``. Writes one JSON object with the wall times and the reward per
generation batch.

    .cache/bench-venv/bin/python bench/trl_peer_script.py --model .cache/models/tiny-arith --out /tmp/trl.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # mugrpo_async.data.task and .reward (pure Python + math-verify)

from mugrpo_async.data.task import generate_problems, prompt_text  # noqa: E402
from mugrpo_async.rewards.boxed_math import boxed_reward  # noqa: E402

RL_SEED_OFFSET = 10_000  # as mugrpo_async.data.pool (which needs the project's config stack to import)
log = logging.getLogger("trl_peer")


def reward(completions: list[str], answer: list[str], **_) -> list[float]:
    """The project's reward on each completion (1.0 when the last boxed answer verifies)."""
    return [boxed_reward(c, a) for c, a in zip(completions, answer)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--updates", type=int, default=128)
    p.add_argument("--b-mini", type=int, default=16, help="groups per update")
    p.add_argument("--g", type=int, default=8, help="responses per prompt")
    p.add_argument("--mu", type=int, default=32, help="updates per generation batch (TRL steps_per_generation)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-problems", type=int, default=20000)
    return p.parse_args(argv)


def grpo_config(args: argparse.Namespace):
    """TRL's config for the same work as the project's staged run (see the module docstring)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-peer-"),
        per_device_train_batch_size=args.b_mini * args.g,
        gradient_accumulation_steps=1,
        steps_per_generation=args.mu,
        num_generations=args.g,
        max_completion_length=args.max_new_tokens,
        max_steps=args.updates,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=1.0,
        epsilon_high=4.0,
        loss_type="grpo",
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
        disable_dropout=True,
        dataloader_num_workers=0,
    )


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    problems = generate_problems(args.num_problems, seed=RL_SEED_OFFSET + args.seed, levels=(1, 2, 3, 4))
    data = Dataset.from_list([{"prompt": prompt_text(p), "answer": p.answer} for p in problems])
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    config = grpo_config(args)
    steps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            steps.append(time.perf_counter())

    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok, callbacks=[Clock()]
    )
    t_ready = time.perf_counter()
    trainer.train()
    t_end = time.perf_counter()
    per_gen = [h["reward"] for h in trainer.state.log_history if "reward" in h]  # logged once per generation batch
    out = {
        "updates": len(steps),
        "setup_s": t_ready - t_start,
        "train_s": t_end - t_ready,
        "per_update_s": (t_end - t_ready) / max(len(steps), 1),
        "reward_per_generation": per_gen,
        "step_end_s": [s - t_ready for s in steps],
    }
    Path(args.out).write_text(json.dumps(out))
    log.info(
        "TRL: %d updates in %.1fs (%.3fs each), reward per generation %s",
        len(steps),
        out["train_s"],
        out["per_update_s"],
        [round(r, 3) for r in per_gen],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
