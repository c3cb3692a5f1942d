"""Weight sync: how the trainer's weights reach every rollout engine (``weight_sync.backend``).

Backends, one interface (:class:`~mugrpo_async.weight_sync.coordinator.WeightSync`: ``broadcast(version)``
publishes the trainer's weights and loads them into every engine in place):

- ``object_store``: trainer rank 0 packs the weights into one buffer (`mugrpo_async.training.weights`), the
  driver hands its object ref to every worker, each fetches it and reloads its engine.
- ``collective``: a process group of its own between trainer rank 0 and every engine's vLLM worker (gloo on
  CPU, NCCL on GPU; `mugrpo_async.weight_sync.group`); rank 0 broadcasts the weights in buckets and each
  engine loads them as they arrive. Staged (sync) mode only: every engine must take part at once, while in
  the async mode each engine picks up new weights at its own generation boundary.
- ``cuda_ipc``: colocated devices (``placement.mode = colocated``), staged mode: every trainer rank puts each
  bucket in a staging buffer of its own device and the engine worker on that device reads it through a handle
  (CUDA IPC on GPU; on CPU the same protocol over shared memory), `mugrpo_async.weight_sync.ipc`.
- ``auto`` (default): :func:`resolve_backend`.

``collective`` has run on CPU (gloo) only; its NCCL path has not run on a GPU. ``cuda_ipc`` has run on CPU
(shared memory) only; its CUDA IPC handles have not been opened by a vLLM engine on a GPU.

Imports without torch or Ray (the coordinator imports Ray inside its methods).
"""

from __future__ import annotations

BACKENDS: tuple[str, ...] = ("auto", "object_store", "collective", "cuda_ipc")

CPU_DEFAULT = "object_store"
"""What ``auto`` picks on CPU in the staged mode: the fastest at 0.46B in benchmark 3 (bench/RESULTS.md)."""

GPU_DEFAULT = "object_store"
"""What ``auto`` picks on GPUs: the NCCL path of ``collective`` has not run on a GPU yet, so not before it has."""

COLOCATED_GPU_DEFAULT = "cuda_ipc"
"""What ``auto`` picks in the staged mode on colocated GPUs: the weights never leave the GPU (the object store's
path crosses host memory twice). Its CUDA IPC handles have not been opened by a vLLM engine on a GPU yet: a sync
in which an engine fails falls back to ``object_store`` for that engine, and two in a row make the run keep to it
(:class:`~mugrpo_async.weight_sync.coordinator.CollectiveSync`). On colocated CPUs ``auto`` keeps
:data:`CPU_DEFAULT`: there cuda_ipc's shared memory was slower than the object store at 0.46B (benchmark 3)."""


def resolve_backend(backend: str, mode: str, on_gpu: bool, colocated: bool = False) -> str:
    """The backend a run uses for ``weight_sync.backend`` = ``backend`` in ``schedule.mode`` = ``mode``.

    ``auto``: ``object_store`` in the async mode (engines load new weights one at a time), else
    :data:`COLOCATED_GPU_DEFAULT` on colocated GPUs, else :data:`GPU_DEFAULT` or :data:`CPU_DEFAULT`.
    """
    if backend != "auto":
        return backend
    if mode == "async":
        return "object_store"
    if colocated and on_gpu:
        return COLOCATED_GPU_DEFAULT
    return GPU_DEFAULT if on_gpu else CPU_DEFAULT


def describe_backend(backend: str, mode: str, on_gpu: bool, colocated: bool, bucket_mb: float) -> str:
    """One line for ``--dry-run``: the backend chosen, and what it holds while it syncs."""
    chosen = resolve_backend(backend, mode, on_gpu, colocated)
    how = {
        "object_store": "rank 0 packs into a host buffer (two, alternating), Ray's object store carries it",
        "collective": f"trainer rank 0 broadcasts {bucket_mb:g} MiB buckets over a {'NCCL' if on_gpu else 'gloo'} "
        "group with every engine worker",
        "cuda_ipc": f"every rank stages {bucket_mb:g} MiB buckets in 2 buffers of its device, the engine worker "
        f"there reads them ({'CUDA IPC' if on_gpu else 'shared memory'})",
    }[chosen]
    return f"weight sync       {chosen}{' (auto)' if backend == 'auto' else ''}: {how}"


def backend_problems(backend: str, mode: str, on_gpu: bool, colocated: bool = False) -> list[str]:
    """Why ``weight_sync.backend`` = ``backend`` cannot run in this config (empty: it can)."""
    if backend in ("collective", "cuda_ipc") and mode == "async":
        return [f"weight_sync.backend: {backend} needs schedule.mode=sync (every engine joins each sync at once); "
                "the async mode uses object_store"]  # fmt: skip
    if backend == "cuda_ipc" and not colocated:
        what = "GPU" if on_gpu else "device (CPU: node and device index)"
        return [f"weight_sync.backend: cuda_ipc needs placement.mode=colocated: each engine worker reads the weights "
                f"from the trainer rank on its own {what}; split layouts use collective or object_store"]  # fmt: skip
    return []
