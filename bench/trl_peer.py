"""Benchmark 6, a peer on the same work: TRL's GRPOTrainer against the staged mu-GRPO run, on the tiny task and on
the multi-step task.

TRL runs in its own environment (``.cache/bench-venv``; TRL is never a project dependency) through
``bench/trl_peer_script.py``: the same model folder, the same prompt pool and reward as the project's run of that
config (``configs/tiny-cpu.yaml``: the arithmetic task; ``configs/tiny-cpu-reasoning.yaml``: the multi-step task,
responses up to 128 tokens), G = 8, B_mini = 16 groups per update, one generation batch per mu = 32 updates (TRL
``steps_per_generation``), the same ratio bounds [0, 5] (``epsilon=1, epsilon_high=4``), AdamW lr 1e-4, 128
updates; generation with transformers on the CPU (TRL's vLLM path needs a GPU server or CUDA vLLM). The peer's
settings are read from the same config as the project's run (model, levels, prompt length limit, G, response
limit, lr, seed). Figures per task: wall-clock per update (without start-up on both sides) and the reward of the
last generation batch / stage. The multi-step run is benchmark 8's first mu-GRPO run (same overrides, so an
invocation of both runs it once). Create the peer environment once (from ``bench/peer-requirements.txt``, by
name from the package registries) with::

    make bench-peer
    .venv/bin/python -m bench.run --only 6 [--smoke]
"""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
from pathlib import Path

from bench import staging, staging_reasoning
from bench.common import BENCH_VENV, REPO, Row, Section, TrainRun, bench_command, md_table, ratio, run_env

log = logging.getLogger(__name__)
REWARD_TOLERANCE = 0.01  # ~2 standard errors of a stage's mean reward over 4096 samples
TINY_CONFIG = "configs/tiny-cpu.yaml"
TARGET = ">= 3x at equal or better reward"


def peer_python() -> Path | None:
    """The bench venv's Python if TRL is importable there, else None."""
    py = BENCH_VENV / "bin" / "python"
    if not py.is_file():
        return None
    ok = subprocess.run([str(py), "-c", "import trl"], capture_output=True, env=run_env())
    return py if ok.returncode == 0 else None


def peer_params(config: str, p: dict) -> dict:
    """The peer script's flags for the work of the project's run of ``config`` with benchmark params ``p``."""
    from mugrpo_async.config import load_config

    cfg = load_config(REPO / config)
    return {
        "model": cfg.model.path,
        "task": cfg.data.source,
        "levels": ",".join(str(x) for x in cfg.data.levels),
        "max_prompt_tokens": cfg.data.max_prompt_tokens,
        "num_problems": cfg.data.num_problems,
        "seed": cfg.run.seed,
        "g": cfg.rollout.group_size,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "lr": cfg.trainer.lr,
        "updates": p["updates"],
        "b_mini": p["b_mini"],
        "mu": p["mu_grpo_mu"],
    }


def run_peer(py: Path, params: dict, timeout_s: float = 1800) -> tuple[dict, str]:
    """Run the TRL script with ``params`` (flags without dashes); returns (its JSON result, the command)."""
    out = Path(tempfile.mkdtemp(prefix="trl-peer-")) / "result.json"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in params.items()]
    argv = [str(py), "bench/trl_peer_script.py", "--out", str(out), *flags]
    cmd = " ".join([".cache/bench-venv/bin/python bench/trl_peer_script.py --out result.json", *flags])
    log.info("peer: %s", cmd)
    proc = subprocess.run(argv, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL peer exited {proc.returncode}: {proc.stderr[-4000:]}")
    return json.loads(out.read_text()), cmd


def steps_run(smoke: bool) -> tuple[TrainRun, dict]:
    """The mu-GRPO run on the multi-step task: benchmark 8's first mu-GRPO run, so that one invocation of both
    benchmarks runs it once; returns (the run, the benchmark params)."""
    p = staging_reasoning.SMOKE if smoke else staging_reasoning.FULL
    return staging_reasoning.staged_run(p, 0, "mu_grpo"), p


def mean_lengths(run: TrainRun, g: int) -> list[float]:
    """Mean response tokens per stage of a run (``response_tokens`` over the stage's ``groups`` x G samples)."""
    return [s["response_tokens"] / max(s["groups"] * g, 1) for s in run.stages]


def compare(task: str, mu: TrainRun, peer: dict, g: int) -> dict:
    """The side-by-side figures of one task."""
    ours_s = mu.t_run / len(mu.updates)
    ours_r, peer_r = mu.end["reward_per_stage"][-1], peer["reward_per_generation"][-1]
    return {"task": task, "speed": ratio(peer["per_update_s"], ours_s), "ours_s": ours_s, "ours_r": ours_r,
            "peer_r": peer_r, "ours_len": mean_lengths(mu, g), "peer": peer, "run": mu}  # fmt: skip


def _limit(c: dict) -> str:
    peer, ours_len, peer_len = c["peer"], c["ours_len"], c["peer"].get("mean_length_per_generation") or []
    text = (f"{c['task']}: TRL takes {peer['per_update_s']:.3f} s per update, this project {c['ours_s']:.3f} s; "
            f"mean response tokens per stage {' -> '.join(f'{x:.1f}' for x in ours_len)} here, per generation "
            f"batch {' -> '.join(f'{x:.1f}' for x in peer_len if x is not None)} in TRL. ")  # fmt: skip
    if c["speed"] < 3 and c["task"] == "tiny task":
        text += ("Speed: the tiny model makes generation and training so cheap that per-step bookkeeping (vLLM's "
                 "scheduler and output processing, actor calls) weighs as much as the arithmetic. ")  # fmt: skip
    if c["ours_r"] < c["peer_r"] - REWARD_TOLERANCE:
        text += (f"Reward: {c['ours_r']:.3f} against {c['peer_r']:.3f} (same prompt pool and reward; TRL has no "
                 "veto and draws its own prompt order)")  # fmt: skip
    return text.strip()


def _row(c: dict, cmd: str) -> Row:
    met = c["speed"] >= 3.0 and c["ours_r"] >= c["peer_r"] - REWARD_TOLERANCE
    return Row(f"wall-clock per update, TRL / mu-GRPO (both without start-up), {c['task']}; reward of the last stage",
               TARGET, f"{c['speed']:.2f}x; reward {c['ours_r']:.3f} vs TRL {c['peer_r']:.3f}", met, cmd,
               _limit(c))  # fmt: skip


def _table(cs: list[dict]) -> str:
    def arrows(xs: list, fmt: str = "{:.3f}") -> str:
        return " -> ".join(fmt.format(x) for x in xs if x is not None)

    rows = []
    for c in cs:
        mu, peer = c["run"], c["peer"]
        rows += [[c["task"], "mu-GRPO staged (this project)", len(mu.updates), f"{mu.end['T_setup']:.1f}",
                  f"{mu.t_run:.1f}", f"{c['ours_s']:.3f}", arrows(mu.end["reward_per_stage"]),
                  arrows(c["ours_len"], "{:.1f}")],
                 [c["task"], "TRL GRPOTrainer", peer["updates"], f"{peer['setup_s']:.1f}", f"{peer['train_s']:.1f}",
                  f"{peer['per_update_s']:.3f}", arrows(peer["reward_per_generation"]),
                  arrows(peer.get("mean_length_per_generation") or [], "{:.1f}")]]  # fmt: skip
    head = ["task", "run", "updates", "start-up s", "training wall s", "s / update", "reward per stage / batch",
            "mean response tokens per stage / batch"]  # fmt: skip
    return md_table(head, rows)


def run(smoke: bool) -> Section:
    cmd = bench_command(6, smoke)
    sec = Section(6, "Peer on the same work: TRL GRPOTrainer vs mu-GRPO staged, tiny and multi-step tasks")
    py = peer_python()
    if py is None:
        reason = f"no TRL environment at {BENCH_VENV} (`make bench-peer` creates it)"
        sec.rows = [Row("wall-clock per update, TRL / mu-GRPO, tiny and multi-step tasks", TARGET,
                        f"not measured: {reason}", None, cmd)]  # fmt: skip
        return sec
    p = staging.SMOKE if smoke else staging.FULL
    _, mu = staging.runs(smoke)
    tiny = peer_params(TINY_CONFIG, p)
    peer, peer_cmd = run_peer(py, tiny)
    steps_mu, sp = steps_run(smoke)
    steps = peer_params(staging_reasoning.CONFIG, sp)
    peer_steps, steps_cmd = run_peer(py, steps)
    cs = [compare("tiny task", mu, peer, tiny["g"]), compare("multi-step task", steps_mu, peer_steps, steps["g"])]
    sec.rows = [_row(c, cmd) for c in cs]
    versions = ", ".join(f"{k} {v}" for k, v in (peer.get("versions") or {}).items())
    sec.details = [
        _table(cs),
        f"Runs: `{mu.cmd}`; `{peer_cmd}`; `{steps_mu.cmd}`; `{steps_cmd}`. Peer environment: {versions}. Rewards are "
        "the mean over each stage's (generation batch's) samples; 'equal' allows "
        f"{REWARD_TOLERANCE} (about two standard errors of a 4096-sample mean).",
    ]
    sec.data = {"peer": peer, "ours_per_update_s": cs[0]["ours_s"], "peer_steps": peer_steps,
                "ours_steps_per_update_s": cs[1]["ours_s"],
                "ours_mean_length": cs[0]["ours_len"], "ours_steps_mean_length": cs[1]["ours_len"]}  # fmt: skip
    return sec
