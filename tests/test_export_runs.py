"""``launch.export_runs``: a study's finished runs, configs and gzipped metrics, into a folder to commit."""

from __future__ import annotations

import gzip
import json

from launch.export_runs import export, finished, main, restore


def _run(folder, records):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("algo: {name: grpo}\n")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "checkpoints" / "update-1").mkdir(parents=True)
    (folder / "checkpoints" / "update-1" / "model.bin").write_bytes(b"x" * 100)


def test_only_finished_runs_are_copied_with_the_reports_and_the_initial_scores(tmp_path, monkeypatch):
    src, dst = tmp_path / "study", tmp_path / "export"
    done = [{"kind": "update", "update": 1}, {"kind": "end", "updates": 1}]
    _run(src / "grpo" / "seed-0", done)
    _run(src / "relaxed" / "seed-0", [{"kind": "update", "update": 1}])
    (src / "initial").mkdir()
    (src / "initial" / "seed-0.json").write_text("{}")
    (src / "study.md").write_text("# report\n")
    (dst / "stale").mkdir(parents=True)  # an earlier export is replaced whole
    copied, skipped = export(src, dst)
    assert [str(p) for p in copied] == ["grpo/seed-0"] and [str(p) for p in skipped] == ["relaxed/seed-0"]
    with gzip.open(dst / "grpo" / "seed-0" / "metrics.jsonl.gz", "rt") as f:
        assert [json.loads(x) for x in f] == done
    run = dst / "grpo" / "seed-0"
    assert (run / "config.yaml").is_file() and not (run / "checkpoints").exists()
    assert (dst / "initial" / "seed-0.json").is_file() and (dst / "study.md").is_file()
    assert not (dst / "relaxed").exists() and not (dst / "stale").exists()
    assert finished(src / "grpo" / "seed-0" / "metrics.jsonl")
    assert not finished(src / "relaxed" / "seed-0" / "metrics.jsonl")
    first = (run / "metrics.jsonl.gz").read_bytes()
    monkeypatch.setattr(gzip.time, "time", lambda: 1e9)  # a later export, at another time
    export(src, tmp_path / "again")  # no timestamp in the archive: the same run exports to the same bytes
    assert (tmp_path / "again" / "grpo" / "seed-0" / "metrics.jsonl.gz").read_bytes() == first


def test_a_missing_source_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "no such study folder" in capsys.readouterr().err


def test_restore_unpacks_an_export_and_never_overwrites_a_run(tmp_path, capsys):
    src, packed, back = tmp_path / "study", tmp_path / "export", tmp_path / "again"
    done = [{"kind": "update", "update": 1}, {"kind": "end", "updates": 1}]
    _run(src / "grpo" / "seed-0", done)
    _run(src / "relaxed" / "seed-0", done)
    (src / "initial").mkdir()
    (src / "initial" / "seed-0.json").write_text('{"a": 1}')
    export(src, packed)
    (back / "relaxed" / "seed-0").mkdir(parents=True)
    (back / "relaxed" / "seed-0" / "metrics.jsonl").write_text("newer\n")  # a run already here is kept
    assert main(["--restore", str(packed), str(back)]) == 0
    assert "1 runs restored" in capsys.readouterr().out
    run = back / "grpo" / "seed-0"
    assert (run / "metrics.jsonl").read_bytes() == (src / "grpo" / "seed-0" / "metrics.jsonl").read_bytes()
    assert finished(run / "metrics.jsonl")
    assert (run / "config.yaml").is_file() and not (run / "checkpoints").exists()
    assert (back / "relaxed" / "seed-0" / "metrics.jsonl").read_text() == "newer\n"
    assert (back / "initial" / "seed-0.json").read_text() == '{"a": 1}'
    restored, kept = restore(packed, back)  # a second restore finds every run in place
    assert restored == [] and [str(p) for p in kept] == ["grpo/seed-0", "relaxed/seed-0"]
    assert main(["--restore", str(tmp_path / "none"), str(back)]) == 2
