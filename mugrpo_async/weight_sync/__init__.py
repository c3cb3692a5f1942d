"""Weight sync: how the trainer's weights reach every rollout engine (``weight_sync.backend``).

Backends, one interface (:class:`~mugrpo_async.weight_sync.coordinator.WeightSync`: ``broadcast(version)``
publishes the trainer's weights and loads them into every engine in place):

- ``object_store``: trainer rank 0 packs the weights into one buffer (`mugrpo_async.training.weights`), the
  driver hands its object ref to every worker, each fetches it and reloads its engine.
- ``collective``: a process group of its own between trainer rank 0 and every engine's vLLM worker (gloo on
  CPU, NCCL on GPU; `mugrpo_async.weight_sync.group`); rank 0 broadcasts the weights in buckets and each
  engine loads them as they arrive. Staged (sync) mode only: every engine must take part at once, while in
  the async mode each engine picks up new weights at its own generation boundary.
- ``cuda_ipc``: colocated GPUs only; not built yet (the config says so).
- ``auto`` (default): :func:`resolve_backend`.

``collective`` has run on CPU (gloo) only; its NCCL path has not run on a GPU.

Imports without torch or Ray (the coordinator imports Ray inside its methods).
"""

from __future__ import annotations

BACKENDS: tuple[str, ...] = ("auto", "object_store", "collective", "cuda_ipc")

CPU_DEFAULT = "object_store"
"""What ``auto`` picks on CPU in the staged mode: the faster of the two measured by benchmark 3 (bench/RESULTS.md)."""

GPU_DEFAULT = "object_store"
"""What ``auto`` picks on GPUs: the NCCL path of ``collective`` has not run on a GPU yet, so not before it has."""


def resolve_backend(backend: str, mode: str, on_gpu: bool) -> str:
    """The backend a run uses for ``weight_sync.backend`` = ``backend`` in ``schedule.mode`` = ``mode``.

    ``auto``: ``object_store`` in the async mode (engines load new weights one at a time), else
    :data:`GPU_DEFAULT` or :data:`CPU_DEFAULT`.
    """
    if backend != "auto":
        return backend
    if mode == "async":
        return "object_store"
    return GPU_DEFAULT if on_gpu else CPU_DEFAULT


def backend_problems(backend: str, mode: str, on_gpu: bool) -> list[str]:
    """Why ``weight_sync.backend`` = ``backend`` cannot run in this config (empty: it can)."""
    if backend == "cuda_ipc":
        if not on_gpu:
            return ["weight_sync.backend: cuda_ipc needs GPUs (trainer.gpus_per_rank > 0): CUDA IPC hands GPU memory "
                    "between processes of one node; on CPU use collective or object_store"]  # fmt: skip
        return ["weight_sync.backend: cuda_ipc is not available yet: use collective (NCCL) or object_store"]
    if backend == "collective" and mode == "async":
        return ["weight_sync.backend: collective needs schedule.mode=sync (every engine joins each broadcast at "
                "once); the async mode uses object_store"]  # fmt: skip
    return []
