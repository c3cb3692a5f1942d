"""The ``cuda_ipc`` weight sync between two processes of one device, without vLLM: its bytes/s against a copy
within that device.

This process plays trainer rank 0: it stages a bf16 state bucket by bucket (`mugrpo_async.weight_sync.ipc`,
``share_state``, the buckets of ``weight_sync.bucket_mb``); a reader process (spawned, as an engine's vLLM worker
is a process of its own) opens each bucket through its handle, copies it out and acks, as an engine does before
``reload_weights``, and checks every tensor it got against the value the sync wrote. Sizes: a 0.5B and a 7B
model's state on a GPU (``bench.gpu_check`` runs this there); with ``--smoke`` a 2M state over shared memory on
CPU, the same protocol.

    python -m bench.ipc_check [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import socket
import time

import torch

SIZES = {"0.5b": 0.494e9, "7b": 7.6e9}
SMOKE_SIZES = {"2m": 2e6}
_BLOCKS = 24


def _value(version: int, block: int) -> float:
    """What sync ``version`` writes into block ``block``: exact in bf16."""
    return ((version * 7 + block) % 13 + 1) / 16


def _state(nparams: float, device: torch.device) -> dict[str, torch.Tensor]:
    width = 1024
    rows = max(1, int(nparams) // (_BLOCKS * width))
    return {f"model.layers.{b}.mlp.weight": torch.empty(rows, width, dtype=torch.bfloat16, device=device)
            for b in range(_BLOCKS)}  # fmt: skip


def _reader(port: int, key: str, syncs: int, out) -> None:
    from mugrpo_async.weight_sync.ipc import join, read_state

    if key.startswith("cuda/"):
        torch.cuda.set_device(0)
    member = join("127.0.0.1", port, key, timeout_s=300, reads=True)
    out.put("joined")
    for sync_id in range(1, syncs + 1):
        version, weights = read_state(member, sync_id)
        got, wrong = 0, 0
        for name, t in weights:
            block = int(name.split(".")[2])
            got += 1
            wrong += not bool((t == _value(version, block)).all())
        out.put((version, got, wrong))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _copy_s(nbytes: int, device: torch.device, repeats: int) -> float:
    """Best seconds of one copy of ``nbytes`` within ``device``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_size(nparams: float, device: torch.device, repeats: int, bucket_mb: float) -> dict:
    """One state of ``nparams`` bf16 parameters through ``repeats`` syncs to a reader process; best seconds."""
    from mugrpo_async.weight_sync.ipc import device_key, join, leave, share_state

    state, port = _state(nparams, device), _port()
    key = device_key(device, "local", 0)
    trainer = join("127.0.0.1", port, key, timeout_s=300, serve=True)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    reader = ctx.Process(target=_reader, args=(port, key, repeats, out), daemon=True)
    reader.start()
    try:
        assert out.get(timeout=300) == "joined"
        best, nbytes = math.inf, sum(t.numel() * t.element_size() for t in state.values())
        for version in range(1, repeats + 1):
            for b, t in enumerate(state.values()):
                t.fill_(_value(version, b))
            t0 = time.perf_counter()
            share_state(trainer, state, version, version, int(bucket_mb * 2**20), device,
                        lambda ts: contextlib.nullcontext(), lambda ts: True)  # fmt: skip
            best = min(best, time.perf_counter() - t0)
            got = out.get(timeout=300)
            if got != (version, len(state), 0):
                raise RuntimeError(f"sync {version}: the reader got (version, tensors, wrong) = {got}")
        copy_s = _copy_s(nbytes, device, repeats)
    finally:
        leave(trainer)
        reader.join(30)
        if reader.is_alive():
            reader.kill()
    return {"bytes": nbytes, "ipc_s": best, "ipc_gbps": nbytes / best / 1e9, "copy_gbps": nbytes / copy_s / 1e9,
            "of_copy": copy_s / best}  # fmt: skip


def measure(device: torch.device, sizes: dict[str, float], repeats: int = 3, bucket_mb: float = 512.0) -> dict:
    """:func:`measure_size` for every size; a size that fails is reported, not raised."""
    out = {}
    for name, n in sizes.items():
        try:
            out[name] = measure_size(n, device, repeats, bucket_mb)
        except Exception as err:  # noqa: BLE001 - the figure says why
            out[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def describe(results: dict) -> list[str]:
    return [f"cuda_ipc, {name} state: " + (r["error"] if "error" in r else
            f"{r['bytes'] / 1e9:.3g} GB in {r['ipc_s']:.3f} s ({r['ipc_gbps']:.1f} GB/s, "
            f"{r['of_copy']:.0%} of a device-local copy at {r['copy_gbps']:.0f} GB/s)")
            for name, r in results.items()]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a 2M state over shared memory on CPU")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    results = measure(device, SIZES if cuda else SMOKE_SIZES, bucket_mb=512.0 if cuda else 1.0)
    print("\n".join(describe(results)))
    print(json.dumps(results))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
