"""TRL's GRPOTrainer on the project's tiny model and task: the peer of benchmark 6 (run in the bench venv).

Not a project module: it runs in ``.cache/bench-venv`` (``make bench-peer``; TRL is never a project dependency),
started by ``bench/trl_peer.py``. Same model folder, the same synthetic prompt pool as the project's run of the
same ``data.source`` (``--task``): ``synthetic`` draws ``mugrpo_async.data.task``'s problems, ``synthetic_steps``
``mugrpo_async.data.steps_task``'s (the multi-step task), both with the training run's seed and levels, and
prompts longer than ``--max-prompt-tokens`` dropped as the project's pool drops them. G responses per prompt,
B_mini groups per update, one generation batch per ``mu`` updates, AdamW with the same settings, reward =
``mugrpo_async.rewards.boxed_math.boxed_reward`` (the project's default reward function scores with it). Writes one
JSON object with the wall times, the reward and the mean response length per generation batch.

    .cache/bench-venv/bin/python bench/trl_peer_script.py --model .cache/models/tiny-arith --out /tmp/trl.json
    .cache/bench-venv/bin/python bench/trl_peer_script.py --model .cache/models/tiny-steps --task synthetic_steps \\
        --levels 1,2,3,4,5,6,7,8 --max-new-tokens 128 --out /tmp/trl-steps.json
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
sys.path.insert(0, str(REPO))  # the project's task, prompt and reward modules (pure Python + math-verify)

from mugrpo_async.data.prompts import encode_prompts  # noqa: E402
from mugrpo_async.data.steps_task import generate_steps_problems  # noqa: E402
from mugrpo_async.data.steps_task import prompt_text as steps_prompt_text  # noqa: E402
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
    p.add_argument("--task", choices=("synthetic", "synthetic_steps"), default="synthetic", help="data.source")
    p.add_argument("--levels", default="1,2,3,4", help="data.levels, comma-separated")
    p.add_argument("--max-prompt-tokens", type=int, default=32, help="longer prompts dropped")
    return p.parse_args(argv)


def prompt_rows(args: argparse.Namespace, tok) -> list[dict]:
    """The training pool as the project's run of ``args.task`` builds it (``mugrpo_async.data.pool``, which needs
    the config stack to import): the same problems, texts and length filter; ``{"prompt", "answer"}`` rows."""
    levels, seed = tuple(int(x) for x in args.levels.split(",")), RL_SEED_OFFSET + args.seed
    if args.task == "synthetic_steps":
        steps = generate_steps_problems(args.num_problems, seed=seed, levels=levels)
        keys = [(p.id, p.answer, {"level": p.level}) for p in steps]
        kept, _ = encode_prompts([steps_prompt_text(p) for p in steps], keys, tok, "none", args.max_prompt_tokens,
                                 keep_text=True)  # fmt: skip
        return [{"prompt": p["prompt_text"], "answer": p["answer"]} for p in kept]
    problems = generate_problems(args.num_problems, seed=seed, levels=levels)
    texts = [prompt_text(p) for p in problems]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    fits = [len(i) <= args.max_prompt_tokens for i in ids]
    return [{"prompt": t, "answer": p.answer} for t, p, ok in zip(texts, problems, fits) if ok]


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


def versions() -> dict[str, str]:
    """The peer environment's torch, transformers and trl versions (for the results' context)."""
    import torch
    import transformers
    import trl

    return {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__}


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    tok = AutoTokenizer.from_pretrained(args.model)
    data = Dataset.from_list(prompt_rows(args, tok))
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
    gens = [h for h in trainer.state.log_history if "reward" in h]  # logged once per generation batch
    per_gen = [h["reward"] for h in gens]
    out = {
        "updates": len(steps),
        "setup_s": t_ready - t_start,
        "train_s": t_end - t_ready,
        "per_update_s": (t_end - t_ready) / max(len(steps), 1),
        "reward_per_generation": per_gen,
        "mean_length_per_generation": [h.get("completions/mean_length") for h in gens],
        "prompts": len(data),
        "versions": versions(),
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
