"""A study seed continues only on the weights it began with: the digest, the score check of older records, the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

from mugrpo_async.checkpoints.model_folder import weights_digest
from mugrpo_async.reporting.provenance import model_change

REPO = Path(__file__).resolve().parents[1]


def _folder(path: Path, weights: bytes) -> Path:
    path.mkdir()
    (path / "model.safetensors").write_bytes(weights)
    (path / "config.json").write_text(json.dumps({"path": str(path)}))  # not weights: left out of the digest
    return path


def test_the_digest_follows_the_weights_only(tmp_path):
    a = _folder(tmp_path / "a", b"\x00\x01" * 1000)
    b = _folder(tmp_path / "b", b"\x00\x01" * 1000)
    c = _folder(tmp_path / "c", b"\x00\x01" * 999 + b"\x00\x02")
    assert weights_digest(a) == weights_digest(b) and len(weights_digest(a)) == 64
    assert weights_digest(c) != weights_digest(a)
    (b / "model-2.safetensors").write_bytes(b"")  # another weight file counts, even empty
    assert weights_digest(b) != weights_digest(a)
    assert weights_digest("Qwen/Qwen3-1.7B") is None and weights_digest(tmp_path / "c" / "config.json") is None


def _result(pass1, fmt=0.99, tokens=65.0, digest=None):
    out = {"benchmarks": {"heldout": {"pass@1": pass1, "format_rate": fmt, "mean_response_tokens": tokens}}}
    return out | ({"model_sha256": digest} if digest else {})


def test_a_recorded_digest_must_match():
    assert model_change(_result(0.54, digest="a" * 64), "a" * 64) is None
    why = model_change(_result(0.54, digest="a" * 64), "b" * 64)
    assert "bbbbbbbbbbbb" in why and "aaaaaaaaaaaa" in why
    assert model_change(_result(0.54, digest="a" * 64), None) is None  # a hub name: nothing to compare


def test_an_older_record_is_checked_by_its_scores():
    assert model_change(_result(0.5400390625), "a" * 64, _result(0.5400390625)) is None
    why = model_change(_result(0.5400390625), "a" * 64, _result(0.298))
    assert "0.5400390625" in why and "0.298" in why and "heldout" in why
    assert model_change(_result(0.54), "a" * 64, _result(0.54, tokens=64.0)) is not None  # every summary must agree
    assert "could not be evaluated" in model_change(_result(0.54), "a" * 64, None)
    assert model_change({"benchmarks": {}}, "a" * 64, {"benchmarks": {}}) is not None  # no scores prove nothing


def test_the_study_refuses_to_continue_a_seed_on_other_weights(tiny_model, tmp_path):
    """A seed whose untrained evaluation recorded other weights starts none of its runs, and says why."""
    (tmp_path / "initial").mkdir()
    (tmp_path / "initial" / "seed-0.json").write_text(json.dumps(_result(0.5, digest="0" * 64)))
    cmd = [sys.executable, "-m", "launch.study", "--config", "configs/study/tiny.yaml", "--variants", "grpo",
           "--seeds", "0", "--out", str(tmp_path), f"model.path={tiny_model}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "not the one seed 0 began with" in proc.stderr and "000000000000" in proc.stderr
    assert not (tmp_path / "grpo" / "seed-0").exists() and "no finished runs" in proc.stdout


def test_the_kept_study_model_is_the_one_its_runs_use():
    """The second model's weights are committed (a rebuild on another CPU can differ): its config points at them,
    they load, and they are the bytes whose digest the study's first seed recorded."""
    from mugrpo_async.checkpoints.model_folder import check_model_folder
    from mugrpo_async.config import load_config

    folder = REPO / load_config(REPO / "configs/study/steps-1m.yaml").model.path
    check_model_folder(folder)
    assert weights_digest(folder) == "e726ce1d29b668d60e05a71be80c090556e95ab3a7efab0a6a2241d8d6b73070"


def _run(variant, seed, trace, b_mini=16, mu=1024):
    from mugrpo_async.reporting.study import RunData

    updates = [{"update": i + 1, "num_tokens": t, "reward_mean": r} for i, (t, r) in enumerate(trace)]
    return RunData(variant, seed, {"schedule": {"groups_per_update": b_mini, "mu": mu}}, updates=updates)


def test_a_replay_on_another_stage_is_named_at_its_first_parting_update():
    """Arms of one seed at one B_mini must see the same minibatches; the first that differs names the update."""
    from mugrpo_async.reporting.provenance import stage_mismatches

    stage = [(8229.0, 0.5), (7061.0, 0.703125), (9976.0, 0.40625)]
    other = [*stage[:2], (9977.0, 0.40625)]  # one token more in the third minibatch: another stage
    runs = [_run("grpo", 0, stage), _run("relaxed", 0, stage), _run("mu_grpo", 0, other),
            _run("grpo", 1, other), _run("mu_grpo", 1, other[:2]),  # seed 1 has its own stage; a shorter run agrees
            _run("grpo", 0, other[::-1], b_mini=64, mu=256)]  # another B_mini draws other minibatches  # fmt: skip
    checked = stage_mismatches(runs, sources={("grpo", 0), ("grpo", 1)})
    assert set(checked) == {("relaxed", 0), ("mu_grpo", 0), ("mu_grpo", 1)}
    assert checked[("relaxed", 0)] is None and checked[("mu_grpo", 1)] is None
    why = checked[("mu_grpo", 0)]
    assert why.startswith("mu_grpo seed 0 trained on another stage than grpo (update 3:") and "9977.0" in why


def test_the_source_is_the_reference_wherever_it_stands_and_without_it_a_disagreement_names_every_run():
    """A replay listed before its seed's source is still judged against the source; with no source in a group, the
    runs that disagree cannot say which of them holds the seed's stage, so none of them enters the claims."""
    from mugrpo_async.reporting.provenance import stage_mismatches

    stage = [(8229.0, 0.5), (7061.0, 0.703125)]
    other = [stage[0], (7060.0, 0.703125)]
    runs = [_run("mu_grpo", 0, other), _run("runs/p1/grpo/seed-0", 0, stage), _run("relaxed", 0, stage)]
    checked = stage_mismatches(runs, sources={("runs/p1/grpo/seed-0", 0)})
    assert checked[("relaxed", 0)] is None and "than runs/p1/grpo/seed-0 (update 2:" in checked[("mu_grpo", 0)]

    sweep = [_run("grpo", 0, stage, b_mini=64, mu=256), _run("mu_grpo", 0, other, b_mini=64, mu=256)]
    checked = stage_mismatches([runs[1], *sweep], sources={("runs/p1/grpo/seed-0", 0)})  # the source: B_mini 16
    assert set(checked) == {("grpo", 0), ("mu_grpo", 0)}
    why = checked[("grpo", 0)]
    assert why == checked[("mu_grpo", 0)] and why.startswith("seed 0's runs at B_mini 64 trained on different stages")
    assert why.endswith("its source is not here to tell which")
    agreeing = stage_mismatches([_run("grpo", 1, stage, b_mini=64), _run("relaxed", 1, stage, b_mini=64)])
    assert agreeing == {("relaxed", 1): None}
