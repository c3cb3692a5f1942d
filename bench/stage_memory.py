"""A paper-shaped stage on disk, trained through the normal CLI: peak RSS of the driver and of a trainer rank.

For each stage size (groups of G = 8 responses, B_mini = 32, mu = groups / 32 as in the paper's 1024 x 32):

1. the stage folder ``rollouts/stage-0`` is written as the staged driver writes it (its prompts, its chunk plan
   under the paper configs' ``rollout.chunk_tokens`` of 2^24, its config digest), with random token ids of the
   tiny model's vocabulary, response lengths drawn from a long-tailed distribution (lognormal, median 400
   tokens) capped at 3,072 (``finish_reason: length`` there), random log-probs and 0/1 rewards;
2. ``launch.train`` runs on that folder (the stage is complete, so the engine generates nothing), one trainer
   rank, token-budget micro-batches and chunked log-probs as the paper configs, until ``--updates`` updates are
   recorded; then the peak resident set (``VmHWM``) of the driver process and of the trainer rank's process is
   read, and the run is killed;
3. in this process: groups read per second through `mugrpo_async.rollout.shards.read_groups` (random
   minibatches of 32 groups, checksums checked), and the bytes of the driver's index per group (tracemalloc).

The tiny model's folder is copied with ``max_position_embeddings`` 4096 (RoPE has no learned positions) so that
3,072-token responses fit its context.

    .venv/bin/python -m bench.stage_memory --groups 8192 32768 --updates 6
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import psutil

from bench.common import REPO, md_table, run_env

MAX_TOKENS = 3072
G, B_MINI = 8, 32
CHUNK_TOKENS = 2**24  # the paper configs' rollout.chunk_tokens


def long_context_model(src: Path, dst: Path) -> Path:
    """``src`` (the tiny model folder) copied to ``dst`` with 4096 positions."""
    if not (dst / "config.json").is_file():
        shutil.copytree(src, dst, dirs_exist_ok=True)
        cfg = json.loads((dst / "config.json").read_text())
        cfg["max_position_embeddings"] = 4096
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def overrides(n_groups: int, model: Path, out: Path) -> list[str]:
    mu = n_groups // B_MINI
    return [f"model.path={model}", f"run.output_dir={out}", "run.name=stage-memory", "run.dashboard=false",
            "logging.progress=false", "logging.tensorboard=false", "eval.benchmarks=[]",
            f"schedule.groups_per_update={B_MINI}", f"schedule.mu={mu}", f"schedule.total_updates={mu}",
            f"rollout.group_size={G}", f"rollout.max_new_tokens={MAX_TOKENS}", f"rollout.chunk_tokens={CHUNK_TOKENS}",
            "trainer.max_tokens_per_micro_batch=16384", "trainer.logprob_chunk_tokens=1024"]  # fmt: skip


def synthetic_groups(prompts: list[dict], rng: np.random.Generator) -> list:
    """One chunk's groups: the prompts' own ids, long-tailed random responses, 0/1 rewards."""
    import torch

    from mugrpo_async.algo import group_advantages
    from mugrpo_async.rollout.samples import Group

    n = len(prompts)
    lengths = np.minimum(rng.lognormal(np.log(400), 1.0, size=(n, G)).astype(np.int64) + 1, MAX_TOKENS)
    rewards = (rng.random((n, G)) < 0.4).astype(np.float32)
    adv = group_advantages(torch.from_numpy(rewards)).numpy()
    tokens = rng.integers(2, 258, size=int(lengths.sum()), dtype=np.int32)
    lps = -rng.exponential(1.0, size=tokens.size).astype(np.float32)
    cuts = np.cumsum(lengths.ravel())[:-1]
    toks, logps = np.split(tokens, cuts), np.split(lps, cuts)
    return [Group(p["prompt_id"], p["prompt_ids"], p["answer"], toks[k * G : (k + 1) * G], logps[k * G : (k + 1) * G],
                  rewards[k].tolist(), adv[k].tolist(), 0,
                  ["length" if t == MAX_TOKENS else "stop" for t in lengths[k]], {"worker": 0})
            for k, p in enumerate(prompts)]  # fmt: skip


def write_stage(cfg, seed: int = 0) -> dict:
    """The stage-0 folder of ``cfg``'s run, as the staged driver would write it; its sizes and write time."""
    from bench.cluster import prompts as prompt_pool
    from drivers.sync import _seeded, _stage_plan
    from mugrpo_async.data.pool import PromptStream
    from mugrpo_async.rollout.shards import StageWriter

    n = cfg.schedule.groups_per_stage
    stage_dir = Path(cfg.run.output_dir) / "rollouts" / "stage-0"
    prompts = _seeded(cfg, PromptStream(prompt_pool(cfg), seed=cfg.run.seed).take(n), 0, 0)
    plan = _stage_plan(cfg, stage_dir, n, cfg.rollout.num_workers)
    writer = StageWriter.open(stage_dir, 0, cfg.resume_digest(), plan.num_chunks, plan.chunk_size)
    rng, t0 = np.random.default_rng(seed), time.perf_counter()
    for c in writer.missing():
        groups = synthetic_groups(plan.chunk(prompts, c), rng)
        tokens = sum(len(r) for g in groups for r in g.responses)
        writer.add(groups, c, {"num_tokens": tokens, "reward_failures": 0, "t_generate_s": 0.0, "t_reward_s": 0.0})
    writer.finish()
    totals = writer.manifest["totals"]
    return {"write_s": time.perf_counter() - t0, "shards": plan.num_chunks, "groups": totals["groups"],
            "response_tokens": totals["response_tokens"],
            "disk_bytes": sum(e["bytes"] for e in writer.manifest["shards"])}  # fmt: skip


def read_rate(stage_dir: Path, minibatches: int = 40) -> dict:
    """Groups read per second in random minibatches of B_mini, and the driver index's bytes per group."""
    from mugrpo_async.rollout.shards import StageWriter, read_groups

    manifest = json.loads((stage_dir / "manifest.json").read_text())
    tracemalloc.start()
    writer = StageWriter.open(stage_dir, 0, manifest["config_digest"])
    refs = writer.all_refs()
    del writer
    index_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    pickled = len(pickle.dumps(refs, protocol=5))  # what the driver puts into the object store for the ranks
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    rows = 0
    for _ in range(minibatches):
        groups = read_groups([refs[i] for i in rng.choice(len(refs), B_MINI, replace=False)])
        rows += sum(g.group_size for g in groups)
    return {"rows_per_s": rows / (time.perf_counter() - t0), "index_bytes_per_group": index_bytes / len(refs),
            "pickled_index_bytes_per_group": pickled / len(refs)}  # fmt: skip


def _updates(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "update":
            out.append(rec)
    return out


def _peak_rss(proc: psutil.Process) -> int:
    """The process's peak resident set (VmHWM), bytes."""
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def train_until(over: list[str], updates: int, timeout_s: float = 1800) -> dict:
    """``launch.train`` until ``updates`` updates are recorded; the peak RSS of its driver and trainer rank."""
    out = Path(next(o.split("=", 1)[1] for o in over if o.startswith("run.output_dir=")))
    argv = [sys.executable, "-m", "launch.train", "--config", "configs/tiny-cpu.yaml", *over]
    log = out.with_name(out.name + ".log").open("w")
    proc = subprocess.Popen(argv, cwd=REPO, env=run_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    deadline, first = time.monotonic() + timeout_s, None
    try:
        while len(recs := _updates(out / "metrics.jsonl")) < updates:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run ended or timed out before update {updates}: see {log.name}")
            if recs and first is None:
                first = time.monotonic()
            time.sleep(0.2)
        t_updates = time.monotonic() - (first or time.monotonic())
        driver = psutil.Process(proc.pid)
        ranks = [p for p in driver.children(recursive=True) if "TrainerRank" in " ".join(p.cmdline())]
        return {"driver_peak": _peak_rss(driver), "rank_peak": max(map(_peak_rss, ranks), default=0),
                "s_per_update": t_updates / max(len(recs) - 1, 1)}  # fmt: skip
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=120)
        log.close()


def measure(n_groups: int, updates: int, work: Path) -> dict:
    from bench.cluster import tiny_config

    model = long_context_model(Path(tiny_config().model.path), REPO / ".cache" / "bench-models" / "tiny-arith-4k")
    out = work / f"stage-{n_groups}"
    shutil.rmtree(out, ignore_errors=True)
    over = overrides(n_groups, model, out)
    from mugrpo_async.config import load_config

    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", over)
    row = {"groups_per_stage": n_groups, **write_stage(cfg)}
    row |= read_rate(out / "rollouts" / "stage-0")
    row |= train_until(over, updates)
    shutil.rmtree(out / "rollouts", ignore_errors=True)  # gigabytes of random tokens
    return row


def table(rows: list[dict]) -> str:
    gib = 2**30
    return md_table(
        ["groups x 8", "stage tokens", "on disk", "driver peak RSS", "trainer rank peak RSS", "groups/s read",
         "index bytes/group", "s/update", "as Python lists (72 B/token)"],
        [[f"{r['groups']:,}", f"{r['response_tokens'] / 1e6:.0f}M", f"{r['disk_bytes'] / gib:.2f} GiB",
          f"{r['driver_peak'] / gib:.2f} GiB", f"{r['rank_peak'] / gib:.2f} GiB", f"{r['rows_per_s'] / G:,.0f}",
          f"{r['index_bytes_per_group']:.0f}", f"{r['s_per_update']:.1f}",
          f"{72 * r['response_tokens'] / gib:.1f} GiB per process"] for r in rows],
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--updates", type=int, default=6)
    ap.add_argument("--work", type=Path, default=REPO / ".cache" / "bench-stage-memory")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    a = ap.parse_args()
    rows = []
    for n in a.groups:
        rows.append(measure(n, a.updates, a.work))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
