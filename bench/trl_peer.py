"""Benchmark 6, a peer on the same work: TRL's GRPOTrainer against the staged mu-GRPO run of benchmark 1.

TRL runs in its own environment (``.cache/bench-venv``; TRL is never a project dependency) through
``bench/trl_peer_script.py``: the same tiny model folder, synthetic prompt pool, G = 8, B_mini = 16
groups per update, one generation batch per mu = 32 updates (TRL ``steps_per_generation``), the same
ratio bounds [0, 5] (``epsilon=1, epsilon_high=4``), AdamW lr 1e-4, the same reward function, 128
updates; generation with transformers on the CPU (TRL's vLLM path needs a GPU server or CUDA vLLM).
Figures: wall-clock per update (without start-up on both sides) and the reward of the last
generation batch / stage. Create the peer environment once with::

    python3 -m venv .cache/bench-venv
    .cache/bench-venv/bin/pip install /opt/wheels/torch-2.13.0+cpu-*.whl transformers==5.19.0 trl \\
        "math-verify[antlr4_13_2]" py-spy

    .venv/bin/python -m bench.run --only 6 [--smoke]
"""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
from pathlib import Path

from bench import staging
from bench.common import BENCH_VENV, REPO, Row, Section, bench_command, md_table, ratio, run_env

log = logging.getLogger(__name__)
REWARD_TOLERANCE = 0.01  # ~2 standard errors of a stage's mean reward over 4096 samples


def peer_python() -> Path | None:
    """The bench venv's Python if TRL is importable there, else None."""
    py = BENCH_VENV / "bin" / "python"
    if not py.is_file():
        return None
    ok = subprocess.run([str(py), "-c", "import trl"], capture_output=True, env=run_env())
    return py if ok.returncode == 0 else None


def run_peer(py: Path, params: dict, timeout_s: float = 1500) -> tuple[dict, str]:
    """Run the TRL script with ``params``; returns (its JSON result, the command)."""
    out = Path(tempfile.mkdtemp(prefix="trl-peer-")) / "result.json"
    argv = [
        str(py),
        "bench/trl_peer_script.py",
        "--model",
        str(REPO / ".cache" / "models" / "tiny-arith"),
        "--out",
        str(out),
    ] + [f"--{k.replace('_', '-')}={v}" for k, v in params.items()]
    flags = argv[6:]
    cmd = " ".join([".cache/bench-venv/bin/python bench/trl_peer_script.py --model .cache/models/tiny-arith",
                    "--out result.json", *flags])  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL peer exited {proc.returncode}: {proc.stderr[-4000:]}")
    return json.loads(out.read_text()), cmd


def _limit(peer: dict, ours_s: float, speed: float, ours_r: float, peer_r: float) -> str:
    text = f"TRL takes {peer['per_update_s']:.3f} s per update, this project {ours_s:.3f} s; "
    if speed < 3:
        text += ("speed: the tiny model makes generation and training so cheap that per-step bookkeeping (vLLM's "
                 "scheduler and output processing, actor calls) weighs as much as the arithmetic. ")  # fmt: skip
    if ours_r < peer_r - REWARD_TOLERANCE:
        text += (f"Reward: {ours_r:.3f} against {peer_r:.3f} (same samples; TRL has no veto and draws its "
                 "own prompt order)")  # fmt: skip
    return text


def run(smoke: bool) -> Section:
    cmd = bench_command(6, smoke)
    sec = Section(6, "Peer on the same work: TRL GRPOTrainer vs mu-GRPO staged")
    py = peer_python()
    if py is None:
        reason = f"no TRL environment at {BENCH_VENV} (see this module's docstring to create it)"
        sec.rows = [Row("wall-clock per update, TRL / mu-GRPO", ">= 3x at equal or better reward",
                        f"not measured: {reason}", None, cmd)]  # fmt: skip
        return sec
    p = staging.SMOKE if smoke else staging.FULL
    _, mu = staging.runs(smoke)
    peer, peer_cmd = run_peer(py, {"updates": p["updates"], "b_mini": p["b_mini"], "mu": p["mu_grpo_mu"]})
    ours_s = mu.t_run / len(mu.updates)
    speed = ratio(peer["per_update_s"], ours_s)
    ours_r, peer_r = mu.end["reward_per_stage"][-1], peer["reward_per_generation"][-1]
    sec.rows = [Row("wall-clock per update, TRL / mu-GRPO (both without start-up); reward of the last stage",
                    ">= 3x at equal or better reward", f"{speed:.2f}x; reward {ours_r:.3f} vs TRL {peer_r:.3f}",
                    speed >= 3.0 and ours_r >= peer_r - REWARD_TOLERANCE, cmd,
                    _limit(peer, ours_s, speed, ours_r, peer_r))]  # fmt: skip
    ours_rs, peer_rs = (
        " -> ".join(f"{r:.3f}" for r in x) for x in (mu.end["reward_per_stage"], peer["reward_per_generation"])
    )
    rows = [["mu-GRPO staged (this project)", len(mu.updates), f"{mu.end['T_setup']:.1f}", f"{mu.t_run:.1f}",
             f"{ours_s:.3f}", ours_rs],
            ["TRL GRPOTrainer", peer["updates"], f"{peer['setup_s']:.1f}", f"{peer['train_s']:.1f}",
             f"{peer['per_update_s']:.3f}", peer_rs]]  # fmt: skip
    sec.details = [
        md_table(["run", "updates", "start-up s", "training wall s", "s / update", "reward per stage / batch"], rows),
        f"Runs: `{mu.cmd}`; `{peer_cmd}`. Rewards are the mean over each stage's (generation batch's) samples; "
        f"'equal' allows {REWARD_TOLERANCE} (about two standard errors of a 4096-sample mean).",
    ]
    sec.data = {"peer": peer, "ours_per_update_s": ours_s}
    return sec
