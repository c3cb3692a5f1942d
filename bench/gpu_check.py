"""GPU check of the trainer: one rank on one GPU through the project's own actor code, and the GPU test tier.

On a Qwen2-shaped model built in code (Qwen2.5-0.5B's shape, random weights, 494M parameters; nothing from a hub),
one `TrainerRank` (DeepSpeed ZeRO-2, bf16, NCCL, torch AdamW) started by `drivers.trainer_group` runs mu-GRPO
updates on one group of 8 responses x 1024 tokens. It reports tokens/s, MFU (6 x parameters x tokens/s against the
790 TFLOP/s bf16 peak measured on the H200, as in the notes on the device), the peak GPU memory of the rank, and the
weight export as a run publishes (pack into a page-locked buffer, then rank 0's copy into the object store),
``ray.get`` + unpack in the driver, and the copy to the GPU, and the GPU-to-host copy into pageable against
page-locked memory for a 0.5B and a 7B model's state, and the ``cuda_ipc`` weight sync between two processes of
the GPU for the same two states (`bench.ipc_check`); then it stops Ray and runs the ``gpu``-marked tests
(tests/test_gpu.py). Figures go to a JSON file.

On a single-GPU machine with torch, transformers, Ray and DeepSpeed but no vLLM (the H200 device machine), from
the repo root: build the bundle once on the CPU machine with ``bash ../shared/device/make-gpu-bundle.sh``, then
run, carrying ``.gpu-bundle`` (about 3-4 minutes there; under 10)::

    source .gpu-bundle/activate.sh && python -m bench.gpu_check --out $OUT/gpu_check.json

On CPU, ``--smoke`` runs the same code path on a tiny Qwen2 (gloo, no CUDA; the GPU tests skip)::

    .venv/bin/python -m bench.gpu_check --smoke --out runs/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import ipc_check

REPO = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = 790.0  # measured bf16 dense peak of the H200 (notes on the device)
log = logging.getLogger("bench.gpu_check")

SHAPES = {  # Qwen2Config fields
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2),
    "smoke": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
}  # fmt: skip


def build_qwen2_folder(folder: Path, shape: dict, *, sharpen: float = 1.0, seed: int = 0, device: str = "cpu") -> int:
    """Save a Qwen2 causal LM of ``shape`` with random weights (tied embeddings) as a bf16 HF folder; its parameter
    count. ``sharpen`` scales the final norm, so the logits (and the effect of a temperature) grow by that factor."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0,
                         eos_token_id=1, bos_token_id=None)  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.mul_(sharpen)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def synthetic_groups(vocab: int, prompt_len: int, response_len: int, group_size: int = 8, seed: int = 0) -> list:
    """One group of random prompt and response tokens, rewards 0/1, behaviour log-probs of a uniform policy."""
    from mugrpo_async.algo import group_advantages
    from mugrpo_async.rollout.samples import Group

    g = torch.Generator().manual_seed(seed)
    rewards = [float(i % 2) for i in range(group_size)]
    lp = [-math.log(vocab)] * response_len
    return [Group(prompt_id="p0", prompt_ids=torch.randint(2, vocab, (prompt_len,), generator=g).tolist(), answer="0",
                  responses=torch.randint(2, vocab, (group_size, response_len), generator=g).tolist(),
                  behavior_logprobs=[lp] * group_size, rewards=rewards,
                  advantages=group_advantages(torch.tensor([rewards]))[0].tolist(), policy_version=0,
                  finish_reasons=["length"] * group_size)]  # fmt: skip


def trainer_config(folder: Path, out_dir: Path, cuda: bool):
    """One ZeRO-2 bf16 rank (a whole GPU when there is one), one group of 8 responses per update."""
    from mugrpo_async.config import load_config

    return load_config(REPO / "configs" / "tiny-cpu.yaml", [
        f"model.path={folder}", "model.dtype=bfloat16", f"run.output_dir={out_dir}", "run.dashboard=false",
        "logging.progress=false", "logging.tensorboard=false", "rollout.group_size=8", "schedule.groups_per_update=1",
        "trainer.num_ranks=1", "trainer.zero_stage=2", "trainer.micro_batch_size=8", "trainer.lr=1e-6",
        f"trainer.gpus_per_rank={1 if cuda else 0}",
    ])  # fmt: skip


def time_updates(rank, groups_ref, warmup: int, steps: int) -> float:
    """Seconds per update, over ``steps`` consecutive updates after ``warmup`` (driver wall time)."""
    import ray

    for _ in range(warmup):
        ray.get(rank.update_groups.remote(groups_ref))
    t0 = time.perf_counter()
    for _ in range(steps):
        m = ray.get(rank.update_groups.remote(groups_ref))
        assert math.isfinite(m["loss"]) and not m["nonfinite_skipped"], m
    return (time.perf_counter() - t0) / steps


def export_timings(rank, repeats: int, cuda: bool) -> dict:
    """Best seconds of: pack + store (the run's publish: ``pack_weights`` into a page-locked buffer on a GPU, then
    ``take_weights`` until its object is ready), ``ray.get`` + unpack in the driver, copy of every tensor to the GPU
    (0 without CUDA); bandwidth = bytes / (pack + store + get); ``pack_s``: the pack alone (the update path's share)."""
    import ray

    from mugrpo_async.training.weights import unpack_state_dict

    best = {"publish_s": math.inf, "get_s": math.inf, "to_gpu_s": math.inf, "pack_s": math.inf}
    nbytes = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        info, (ref, _) = ray.get([rank.pack_weights.remote(), rank.take_weights.remote()])
        best["pack_s"] = min(best["pack_s"], info["t_pack_s"])
        t1 = time.perf_counter()
        packed = ray.get(ref)
        state = unpack_state_dict(packed)
        t2 = time.perf_counter()
        if cuda:
            on_gpu = [v.to("cuda") for v in state.values()]
            torch.cuda.synchronize()
            del on_gpu
        t3 = time.perf_counter()
        nbytes = packed.nbytes
        for key, value in zip(best, (t1 - t0, t2 - t1, t3 - t2)):
            best[key] = min(best[key], value)
        del ref, packed, state
    gbps = nbytes / (best["publish_s"] + best["get_s"]) / 1e9
    return {"bytes": nbytes, **best, "gbps": gbps}


def host_copy_gbps(nbytes: int, repeats: int = 3) -> dict:
    """GPU to host copy bandwidth (GB/s, best of ``repeats``) into pageable and into page-locked memory, for a
    state of ``nbytes`` bytes (the export's first copy); GPU only."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for kind, dst in (("pageable", torch.empty(nbytes, dtype=torch.uint8)),
                      ("pinned", torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))):  # fmt: skip
        best = math.inf
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=kind == "pinned")
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[kind] = nbytes / best / 1e9
        del dst
    del src
    torch.cuda.empty_cache()
    return out


def measure(args, work: Path, cuda: bool) -> dict:
    """Build the model, start the rank, time updates and exports; the figures."""
    import ray

    from drivers.trainer_group import start_trainer_group

    shape = SHAPES["smoke" if args.smoke else "qwen2-0.5b"]
    folder = work / "model"
    log.info("building the model (%s)", "smoke" if args.smoke else "qwen2-0.5b")
    params = build_qwen2_folder(folder, shape, device="cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.empty_cache()  # the GPU is the rank's now
    prompt_len, response_len = (16, 48) if args.smoke else (256, 768)
    groups = synthetic_groups(shape["vocab_size"], prompt_len, response_len)
    cfg = trainer_config(folder, work / "run", cuda)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=args.verbose)
    try:
        t0 = time.perf_counter()
        (rank,) = start_trainer_group(cfg, [{"num_cpus": 1, "num_gpus": 1 if cuda else 0}])
        t_start = time.perf_counter() - t0
        log.info("trainer rank ready in %.1f s; timing updates", t_start)
        step_s = time_updates(rank, ray.put(groups), *((1, 2) if args.smoke else (2, 8)))
        info = ray.get(rank.device_info.remote())
        log.info("timing the weight export")
        export = export_timings(rank, 2 if args.smoke else 3, cuda)
    finally:
        ray.shutdown()
    tokens = 8 * (prompt_len + response_len)
    tokens_per_s = tokens / step_s
    peak = info["peak_device_memory_bytes"]
    return {"model": {"shape": shape, "params": params}, "tokens_per_update": tokens, "step_s": step_s,
            "tokens_per_s": tokens_per_s, "mfu": 6 * params * tokens_per_s / (PEAK_TFLOPS * 1e12),
            "peak_tflops": PEAK_TFLOPS, "peak_device_memory_gib": None if peak is None else peak / 2**30,
            "trainer_start_s": t_start, "trainer": info, "export": export}  # fmt: skip


def run_gpu_tests(timeout_s: float) -> dict:
    """The ``gpu``-marked tests in their own process (they start their own Ray); exit code and summary line."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode:
        print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
    return {"returncode": proc.returncode, "summary": lines[-1] if lines else proc.stderr[-500:]}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "deepspeed", "ray", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, on CPU when there is no GPU")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check.json", help="where the JSON goes")
    p.add_argument("--no-tests", action="store_true", help="skip the gpu-marked tests")
    p.add_argument("--verbose", action="store_true", help="forward the actors' output")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cuda = torch.cuda.is_available()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")  # transformers may load DeepSpeed's
    if not cuda and not args.smoke:
        print("error: no CUDA device; on CPU run with --smoke", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        figures = measure(args, Path(work), cuda)
    if cuda:  # a 0.5B and a 7B model's bf16 state (2 bytes a parameter)
        figures["host_copy_gbps"] = {name: host_copy_gbps(int(2 * n)) for name, n in ipc_check.SIZES.items()}
    device_ = torch.device("cuda", 0) if cuda else torch.device("cpu")  # cuda_ipc between two processes of it
    figures["ipc"] = ipc_check.measure(device_, ipc_check.SIZES if cuda else ipc_check.SMOKE_SIZES,
                                       bucket_mb=512.0 if cuda else 1.0)  # fmt: skip
    tests = None if args.no_tests else run_gpu_tests(timeout_s=400)
    report = {"smoke": args.smoke, "device": device, "versions": versions(), **figures, "gpu_tests": tests,
              "wall_s": time.perf_counter() - t0}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    e, mem = figures["export"], figures["peak_device_memory_gib"]
    print(f"{device}: {figures['model']['params'] / 1e6:.3g}M parameters, {figures['step_s']:.3f} s/update, "
          f"{figures['tokens_per_s']:.0f} tokens/s, MFU {100 * figures['mfu']:.1f}% of {PEAK_TFLOPS:.0f} TFLOP/s, "
          f"peak memory {'n/a' if mem is None else f'{mem:.1f} GiB'}")  # fmt: skip
    print(f"export {e['bytes'] / 1e9:.3g} GB: pack+store {e['publish_s']:.2f} s, get {e['get_s']:.2f} s "
          f"({e['gbps']:.3g} GB/s), to GPU {e['to_gpu_s']:.2f} s")  # fmt: skip
    for name, r in figures.get("host_copy_gbps", {}).items():
        print(f"GPU to host copy, {name} state: pageable {r['pageable']:.1f} GB/s, pinned {r['pinned']:.1f} GB/s")
    print("\n".join(ipc_check.describe(figures["ipc"])))
    print(f"gpu tests: {'not run' if tests is None else tests['summary']}; figures in {args.out}")
    return 0 if tests is None or tests["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
