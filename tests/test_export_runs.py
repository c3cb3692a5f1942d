"""``launch.export_runs``: a study's finished runs, configs and gzipped metrics, into a folder to commit."""

from __future__ import annotations

import gzip
import json

from launch.export_runs import export, finished, main


def _run(folder, records):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("algo: {name: grpo}\n")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "checkpoints" / "update-1").mkdir(parents=True)
    (folder / "checkpoints" / "update-1" / "model.bin").write_bytes(b"x" * 100)


def test_only_finished_runs_are_copied_with_the_reports_and_the_initial_scores(tmp_path):
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


def test_a_missing_source_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "no such study folder" in capsys.readouterr().err
