"""Unit tests of the update loop's rules (no Ray): due-rules, non-finite streak, pipelining order, stop messages."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from drivers.pipeline import Step, UpdatePipeline
from drivers.stops import NonfiniteUpdates, RunStopped, TrainerFailed, resume_command
from mugrpo_async.config import load_config
from mugrpo_async.training.schedule import NonfiniteStreak, Schedule, checkpoint_interval

REPO = Path(__file__).resolve().parents[1]


def _sched(mode="sync", total=8, mu=4, sync_every=4, ckpt_every=0, eval_every=0, evaluate=False) -> Schedule:
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", [
        f"schedule.mode={mode}", f"schedule.total_updates={total}", f"schedule.mu={mu}",
        f"schedule.sync_every={sync_every}", f"checkpoint.every_updates={ckpt_every}",
        f"eval.every_updates={eval_every}", f"eval.benchmarks={'[heldout]' if evaluate else '[]'}",
    ])  # fmt: skip
    return Schedule.from_config(cfg)


def _when(sched: Schedule, what: str) -> list[int]:
    return [u for u in range(1, sched.total_updates + 1) if getattr(sched.after(u), what)]


def test_sync_two_stages_by_hand():
    # T=8, mu=4: C = min(mu, T // 4) = 2; weights published at each stage end; evaluation every 3 updates
    s = _sched("sync", total=8, mu=4, eval_every=3, evaluate=True)
    assert s.checkpoint_every == 2 and s.publish_every == 4
    assert _when(s, "checkpoint") == [2, 4, 6, 8]
    assert _when(s, "publish") == _when(s, "stage_end") == [4, 8]
    assert _when(s, "evaluate") == [3, 6]  # 9 is past the end; the final policy is evaluated after the loop
    assert _when(s, "barrier") == [2, 3, 4, 6, 8]
    assert [s.policy_version(u) for u in range(1, 9)] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert s.final_eval_due(6) and not s.final_eval_due(8) and s.final_eval_due(-1)


def test_async_total_not_a_multiple_of_sync_every():
    # T=10, mu=1024, sync_every=4: C = min(1024, 10 // 4) = 2; versions 0, 4, 8; no publish after update 10
    s = _sched("async", total=10, mu=1024, sync_every=4)
    assert s.checkpoint_every == 2
    assert _when(s, "checkpoint") == [2, 4, 6, 8, 10]
    assert _when(s, "publish") == [4, 8]
    assert _when(s, "stage_end") == [] and _when(s, "evaluate") == []
    assert [s.policy_version(u) for u in range(1, 11)] == [0, 0, 0, 0, 4, 4, 4, 4, 8, 8]
    assert not s.final_eval_due(-1)  # no benchmarks: nothing to evaluate


def test_one_checkpoint_rule_for_both_modes():
    # the same interval and the same points, whatever the mode; the last update always gets one
    for mode in ("sync", "async"):
        assert _when(_sched(mode, total=12, mu=4, ckpt_every=5), "checkpoint") == [5, 10, 12]
        assert _when(_sched(mode, total=16, mu=4), "checkpoint") == [4, 8, 12, 16]  # every mu (a sync stage)
        assert _when(_sched(mode, total=4, mu=2, sync_every=2), "checkpoint") == [1, 2, 3, 4]  # at least 4 per run
    assert _when(_sched("async", total=3, mu=1024), "checkpoint") == [1, 2, 3]
    assert checkpoint_interval(0, 1024, 4096) == 1024 and checkpoint_interval(0, 1024, 128) == 32
    assert checkpoint_interval(200, 4, 4096) == 200  # a small mu never forces more checkpoints than asked


def test_eval_every_past_the_end_and_at_the_end():
    s = _sched("sync", total=8, mu=4, eval_every=8, evaluate=True)
    assert _when(s, "evaluate") == [] and s.final_eval_due(-1)  # only the final evaluation
    assert _when(_sched("sync", total=8, mu=4, eval_every=3), "evaluate") == []  # no benchmarks


def test_resume_positions():
    s = _sched("sync", total=16, mu=4)
    assert list(s.updates(6)) == list(range(7, 17)) and list(s.updates(16)) == []
    assert list(s.stages(0)) == [0, 1, 2, 3]
    assert list(s.stages(6)) == [1, 2, 3] and list(s.stages(8)) == [2, 3] and list(s.stages(16)) == []
    assert list(s.stage_updates(1, 6)) == [7, 8]  # resumed inside stage 1
    assert list(s.stage_updates(2, 6)) == [9, 10, 11, 12]
    assert list(s.stage_updates(2, 8)) == [9, 10, 11, 12]  # resumed at a stage end: the next stage whole
    with pytest.raises(ValueError, match="outside 1..16"):
        s.after(0)
    with pytest.raises(ValueError, match="outside 1..16"):
        s.after(17)


def test_paper_configs_checkpoint_every_mu_and_grpo_baseline_as_asked():
    paper = Schedule.from_config(load_config(REPO / "configs" / "tiny-cpu.yaml", ["schedule.total_updates=4096",
                                                                                  "schedule.mu=1024"]))  # fmt: skip
    assert _when(paper, "checkpoint") == [1024, 2048, 3072, 4096] == _when(paper, "publish")
    tiny_async = Schedule.from_config(load_config(REPO / "configs" / "tiny-cpu-async.yaml"))
    assert tiny_async.checkpoint_every == 32 and tiny_async.publish_every == 4


def test_nonfinite_streak_stops_at_the_limit_and_resets_on_a_good_update():
    streak = NonfiniteStreak(3)
    flags = [0, 1, 1, 0, 1, 1, 1]  # updates 1..7
    stops = [streak.observe(u, bool(f)) for u, f in enumerate(flags, start=1)]
    assert stops == [False, False, False, False, False, False, True]
    assert streak.count == 3 and streak.first == 5
    text = streak.describe(7)
    assert "updates 5-7" in text and "trainer.max_nonfinite_updates=3" in text
    one = NonfiniteStreak(1)
    assert one.observe(2, True) and "update 2:" in one.describe(2)
    with pytest.raises(ValueError):
        NonfiniteStreak(0)


def test_nonfinite_flag_absent_or_zero_is_a_good_update():
    assert not NonfiniteStreak.skipped({"update": 1})  # trainers that do not report it yet
    assert not NonfiniteStreak.skipped({"nonfinite_skipped": 0.0})
    assert not NonfiniteStreak.skipped({"nonfinite_skipped": None})
    assert NonfiniteStreak.skipped({"nonfinite_skipped": 1.0}) and NonfiniteStreak.skipped({"nonfinite_skipped": 1})


def test_pipeline_records_update_u_after_u_plus_1_is_submitted():
    events: list[str] = []
    pipe = UpdatePipeline(lambda step: events.append(f"record {step.update}") or step.update)

    def submit(u: int) -> None:
        events.append(f"submit {u}")
        pipe.push(Step(u, []))

    submit(1)
    submit(2)
    pipe.drain()  # e.g. an evaluation after update 2
    events.append("evaluate 2")
    pipe.seal_after_next(lambda: events.append("seal 2"))  # a checkpoint after update 2
    submit(3)
    submit(4)
    pipe.close()
    assert events == ["submit 1", "submit 2", "record 1", "record 2", "evaluate 2", "submit 3", "seal 2",
                      "submit 4", "record 3", "record 4"]  # fmt: skip
    assert pipe.last == 4 and pipe.inflight is None


def test_pipeline_checkpoint_needs_nothing_in_flight_and_close_seals():
    sealed = []
    pipe = UpdatePipeline(lambda step: None)
    pipe.push(Step(1, []))
    with pytest.raises(RuntimeError, match="drain"):
        pipe.seal_after_next(lambda: sealed.append(1))
    pipe.drain()
    pipe.seal_after_next(lambda: sealed.append(1))
    pipe.close()  # the last update's checkpoint
    assert sealed == [1]


def test_pipeline_a_failing_record_keeps_the_checkpoint_before_it_and_stops():
    def record(step):
        if step.update == 3:
            raise NonfiniteUpdates("update 3: not finite")
        return step.update

    pipe, sealed = UpdatePipeline(record), []
    pipe.push(Step(1, []))
    pipe.push(Step(2, []))
    pipe.drain()
    pipe.seal_after_next(lambda: sealed.append(2))  # the checkpoint after the good update 2
    pipe.push(Step(3, []))
    with pytest.raises(NonfiniteUpdates):
        pipe.push(Step(4, []))  # update 3's record stops the loop
    assert sealed == [2] and pipe.last == 2


def test_run_writes_every_record_but_publishes_nothing_once_the_streak_stops_it(tmp_path):
    from drivers.rollout_pool import RolloutPool
    from drivers.run import Run
    from mugrpo_async.checkpoints.store import CheckpointStore, Resumable
    from mugrpo_async.reporting.metrics import MetricsSink, read_metrics

    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", ["trainer.max_nonfinite_updates=3"])
    run = Run(cfg, tmp_path, [], 0, [], RolloutPool(cfg, []), MetricsSink(tmp_path, tensorboard=False),
              CheckpointStore(tmp_path), Resumable(), 0.0, 0.0)  # fmt: skip
    (tmp_path / "checkpoints" / "update-00000002").mkdir(parents=True)  # the last good checkpoint
    published = []
    flags = {1: None, 2: 0.0, 3: 1.0, 4: 1.0, 5: 0.0, 6: 1.0, 7: 1.0, 8: 1.0}  # None: a trainer without the key
    for u in range(1, 8):
        rec = {"kind": "update", "update": u} | ({} if flags[u] is None else {"nonfinite_skipped": flags[u]})
        run.write_update(rec, lambda u=u: published.append(u) or {"t_weight_sync_s": 0.5})
    with pytest.raises(NonfiniteUpdates) as stop:
        run.write_update({"kind": "update", "update": 8, "nonfinite_skipped": 1.0}, lambda: published.append(8) or {})
    run.sink.close()
    assert published == [1, 2, 3, 4, 5, 6, 7]  # two skipped in a row never stop; the third is not published
    assert "updates 6-8" in stop.value.reason and stop.value.checkpoint == tmp_path / "checkpoints" / "update-00000002"
    records = read_metrics(tmp_path, "update")
    assert [r["update"] for r in records] == list(range(1, 9))  # the stopping update is recorded too
    assert "t_weight_sync_s" in records[6] and "t_weight_sync_s" not in records[7]


def test_stop_message_names_checkpoint_and_resume_command(tmp_path):
    ckpt = tmp_path / "checkpoints" / "update-00000004"
    err = TrainerFailed("a trainer rank died during update (ActorDiedError)", ckpt)
    assert isinstance(err, RunStopped) and str(ckpt) in str(err) and "Resume" in str(err)
    argv = ["--config", "configs/tiny-cpu.yaml", "--mode", "async", "run.output_dir=/tmp/my run"]
    cmd = resume_command(argv, "auto", [".venv/bin/python", "-m", "launch.train"])
    assert shlex.split(cmd) == [".venv/bin/python", "-m", "launch.train", *argv]
    line = err.describe(cmd)
    assert "\n" not in line and str(ckpt) in line and line.endswith(cmd)
    assert shlex.split(resume_command(argv, "never"))[-1] == "run.resume=auto"
    assert "none (the run starts again from update 0)" in RunStopped("x").describe("cmd")


def test_stage_record_gets_the_first_update_mismatch_and_tensorboard_gets_both(tmp_path):
    from drivers.sync import MISMATCH_KEYS, stage_mismatch
    from mugrpo_async.reporting.metrics import MetricsSink

    first = {"kind": "update", "update": 5, "mismatch_logprob_abs_mean": 0.01, "mismatch_logprob_abs_max": 0.5,
             "mismatch_kl": 0.002, "loss": 1.0}  # fmt: skip
    assert stage_mismatch(first, tmp_path, 5) == {k: first[k] for k in MISMATCH_KEYS}
    assert stage_mismatch({"update": 5, "loss": 1.0}, tmp_path, 5) == {}  # no lag-0 rows: nothing to copy
    sink = MetricsSink(tmp_path, tensorboard=True)
    sink.write(first)
    sink.write({"kind": "stage", "stage": 1, **stage_mismatch({}, tmp_path, 5)})  # read back after a resume
    sink.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for kind, step in (("update", 5), ("stage", 1)):
        for key in MISMATCH_KEYS:
            (point,) = events.Scalars(f"{kind}/{key}")
            assert point.step == step and point.value == pytest.approx(first[key])


def test_queue_gives_back_the_evaluation_a_dead_worker_had_taken():
    import asyncio

    from actors.sample_queue import SampleQueue

    async def scenario() -> list:
        q = SampleQueue.__ray_actor_class__(mu=4, groups_per_update=2, max_groups=8)  # the class behind the actor
        for update in (4, 8):
            await q.request_eval({"update": update})
        assert (await q.next_eval(0))["update"] == 4 and (await q.next_eval(1))["update"] == 8
        await q.release_worker(1)  # worker 1 died while evaluating update 8; worker 0 still evaluates 4
        again = await q.next_eval(0)
        await q.finish_eval(4, {}, 1.0)
        await q.release_worker(1)  # nothing more of worker 1's to give back
        return [again["update"], await q.next_eval(0), [u for u, _, _ in await q.eval_results()]]

    assert asyncio.run(scenario()) == [8, None, [4]]
