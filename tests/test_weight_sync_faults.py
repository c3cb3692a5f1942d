"""Integration: the ``collective`` weight sync against ``object_store`` in whole runs, and under an engine's death.

- With ``rollout.seeded_sampling=true`` a staged CLI run gives the same samples, log-probs and rewards per stage
  with either backend: the engines hold bit-identical weights either way.
- An engine whose process exits in the middle of a collective broadcast: trainer rank 0 stops sending, the other
  engine's wait for the next bucket times out (``weight_sync.timeout_s``), the broadcast returns, the surviving
  engine (through the object store) and the dead one (restarted by the pool, then the same) hold the trainer's
  weights (log-probs equal to the trainer's), and the next collective broadcast, over a group formed anew,
  reaches both.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import time

import numpy as np
import pytest

from mugrpo_async.reporting.metrics import read_metrics
from mugrpo_async.rollout.shards import read_stage
from tests.conftest import REPO, tiny_config
from tests.test_faults import _cmd
from tests.test_stack import _max_gap, _prompts
from tests.test_weight_sync import _SYNC, _perturb, _run_of

pytestmark = pytest.mark.slow


def _stages(out) -> list[list]:
    """Each stage's groups, in prompt order."""
    stages = read_metrics(out, "stage")
    return [sorted(read_stage(out / "rollouts" / f"stage-{s['stage']}")[1], key=lambda g: g.prompt_id) for s in stages]


def test_seeded_run_has_the_same_rewards_with_collective_and_object_store(ray_cluster, tiny_model, tmp_path):
    args = ["schedule.total_updates=4", "schedule.mu=2", "schedule.groups_per_update=4", "rollout.seeded_sampling=true",
            "rollout.warmup=false", "weight_sync.bucket_mb=0.1"]  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}  # no Ray start per run
    ends, stages = {}, {}
    for backend in ("object_store", "collective"):
        out = tmp_path / backend
        proc = subprocess.run(_cmd(tiny_model, out, *args, f"weight_sync.backend={backend}"), cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert ("weight sync: gloo group" in proc.stderr) == (backend == "collective")
        (ends[backend],) = read_metrics(out, "end")
        stages[backend] = _stages(out)
    assert len(ends["collective"]["reward_per_stage"]) == 2
    assert ends["collective"]["reward_per_stage"] == ends["object_store"]["reward_per_stage"]
    # stage 1 samples from the weights after 2 updates, loaded by each backend: every token and its log-prob agree
    for a, b in zip(stages["object_store"], stages["collective"], strict=True):
        assert [g.prompt_id for g in a] == [g.prompt_id for g in b]
        for ga, gb in zip(a, b):
            assert all(np.array_equal(x, y) for x, y in zip(ga.responses, gb.responses, strict=True))
            assert all(np.array_equal(x, y) for x, y in zip(ga.behavior_logprobs, gb.behavior_logprobs, strict=True))
            assert ga.rewards == gb.rewards and ga.policy_version == gb.policy_version


_TIMEOUT_S = 5  # weight_sync.timeout_s of the fault test: what a member waits for a dead one


def _exit_mid_sync(actor) -> None:
    """In a rollout worker (``__ray_call__``): its process exits in the next weight sync, once the sync has begun
    (its plan read, the engine's ``reload_weights`` called) and before it posts a receive: gloo sends only into a
    posted receive, so trainer rank 0's send to it fails once it is gone, and rank 0 stops mid-sync."""
    actor.llm.collective_rpc(_exit_on_reload)


def _exit_on_reload(worker) -> None:
    w = getattr(worker, "worker", worker)

    def reload_weights(weights_iterator, **_):
        os._exit(1)

    w.reload_weights = reload_weights


def _engines_match(ray, run, trainer, prompts, version: int) -> None:
    for w in run.pool.workers:
        assert ray.get(w.info.remote())["policy_version"] == version
        groups = ray.get(w.generate.remote(prompts))["groups"]
        worst, _ = _max_gap(groups, ray.get(trainer.logprobs.remote(groups)))
        assert worst < 1e-3, (version, worst)


def _broadcast(sync, version: int, limit_s: float) -> float:
    """``sync.broadcast(version)`` in a thread that must end within ``limit_s`` (a hang fails the test)."""
    done: dict = {}

    def call():
        try:
            done["s"] = sync.broadcast(version)
        except BaseException as err:  # noqa: BLE001 - raised in the test's thread below
            done["err"] = err

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"broadcast of version {version} still running after {limit_s} s"
    if "err" in done:
        raise done["err"]
    return done["s"]


def test_engine_dying_in_a_collective_sync_is_restarted_and_the_next_sync_reaches_both(
    ray_cluster, tiny_model, tmp_path, caplog
):
    from actors.rollout import RolloutWorker, engine_env
    from drivers.trainer_group import start_trainer_group
    from mugrpo_async.weight_sync.coordinator import make_weight_sync

    cfg = tiny_config(tiny_model, tmp_path, [*_SYNC, f"weight_sync.timeout_s={_TIMEOUT_S}", "rollout.warmup=false",
                                             "rollout.max_restarts=1", "rollout.restart_timeout_s=180"])  # fmt: skip
    opts = {"num_cpus": 1, "runtime_env": {"env_vars": engine_env(cfg)}, "max_restarts": 1, "max_task_retries": 0}
    workers = [RolloutWorker.options(**opts).remote(cfg.to_dict(), i) for i in range(2)]
    trainers = start_trainer_group(cfg, [{"num_cpus": 1}])
    try:
        ray_cluster.get([w.info.remote() for w in workers])
        run = _run_of(cfg, trainers, workers)
        sync, prompts = make_weight_sync(run), _prompts(cfg, 2)
        ray_cluster.get(trainers[0].__ray_call__.remote(_perturb, 1))
        sync.broadcast(1)  # the group is formed and works
        ray_cluster.get(workers[1].__ray_call__.remote(_exit_mid_sync))
        ray_cluster.get(trainers[0].__ray_call__.remote(_perturb, 2))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            t0 = time.time()
            seconds = _broadcast(sync, 2, limit_s=240)
        print(f"broadcast with a dying engine: {seconds:.1f}s\n{caplog.text}")
        assert "a rollout worker died during a collective weight sync" in caplog.text
        # the engine died before posting a receive, so rank 0 stopped sending: the survivor's wait for the next
        # bucket timed out (weight_sync.timeout_s) and it took the weights through the object store
        (failed,) = [r for r in caplog.records if "failed a collective weight sync" in r.getMessage()]
        # gloo words its timeout either way, depending on whether the pair was closed by the timer first
        assert re.search(r"timed out|timeout", failed.getMessage(), re.I) and failed.created - t0 < 3 * _TIMEOUT_S
        assert run.pool.workers == workers and run.pool.restarts == 1  # worker 1 came back
        _engines_match(ray_cluster, run, trainers[0], prompts, 2)
        ray_cluster.get(trainers[0].__ray_call__.remote(_perturb, 3))
        caplog.clear()
        with caplog.at_level(logging.INFO):
            t0 = time.perf_counter()
            _broadcast(sync, 3, limit_s=60)
        print(f"next broadcast: {time.perf_counter() - t0:.1f}s")
        assert "weight sync: gloo group of trainer rank 0 and 2 engine workers" in caplog.text  # formed anew
        assert "collective weight sync" not in caplog.text  # no member failed: both took it over the group
        _engines_match(ray_cluster, run, trainers[0], prompts, 3)
        sync.close()
    finally:
        for a in [*trainers, *workers]:
            ray_cluster.kill(a)
