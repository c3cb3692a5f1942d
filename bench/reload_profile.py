"""Where vLLM's in-place weight reload spends its time: cProfile around ``reload_weights`` in one engine.

Starts an in-process vLLM engine on a model folder (default: benchmark 3's 0.46B Qwen2), reloads a
changed copy of its weights three times (as ``RolloutWorker.update_weights`` does) and prints the
reload times and the profile's top entries of the last one.

    .venv/bin/python -m bench.reload_profile [--model .cache/bench-models/qwen2-0.46b]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

from bench.common import REPO


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / ".cache" / "bench-models" / "qwen2-0.46b"))
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
    from safetensors.torch import load_file
    from vllm import LLM

    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=128)
    state = {}
    for f in sorted(os.listdir(args.model)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(args.model, f)))
    state = {k: v + 0.001 for k, v in state.items()}  # new tensors, every one changed
    mib = sum(v.numel() * v.element_size() for v in state.values()) / 2**20
    profile = cProfile.Profile()
    for i in range(3):
        t0 = time.perf_counter()
        if i == 2:
            profile.enable()
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
        profile.disable()
        print(f"reload {i + 1}: {time.perf_counter() - t0:.3f} s for {mib:.0f} MiB")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
