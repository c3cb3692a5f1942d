"""Unit: the status line, its board (ticks, status.json, gauges callback) and `launch.watch` over a run folder."""

from __future__ import annotations

import io
import json
import threading
import time
from dataclasses import asdict, replace

import pytest

from launch import watch as watch_cli
from mugrpo_async.reporting.status import (
    STATUS_FILE,
    RunStatus,
    StatusBoard,
    format_duration,
    format_status,
    load_status,
    status_from_records,
    write_status,
)


def _status(**kw) -> RunStatus:
    base = RunStatus(run="r1", mode="async", total_updates=16, groups_per_update=4)
    return replace(base, **kw)


def test_format_status_async_and_sync():
    s = _status(updates=12, idle_ratio=0.4312, lag_mean=1.25, lag_max=3, queue_depth=5, generated=70, served=48,
                dropped=2, t_wall_s=75.0)  # fmt: skip
    assert format_status(s) == (
        "r1 [async] update 12/16 | idle 0.431 | lag 1.25 (max 3) | queue 5 | groups generated 70 served 48 dropped 2"
        " | 1m15s"
    )
    sync = replace(s, mode="sync", queue_depth=None, state="finished", t_wall_s=3725)
    line = format_status(sync)
    assert "queue" not in line and line.endswith("| 1h02m finished")
    assert format_status(_status()).startswith("r1 [async] update 0/16 | idle - | lag - (max -)")


@pytest.mark.parametrize("seconds,text", [(0, "0s"), (59.9, "59s"), (60, "1m00s"), (3599, "59m59s"), (7260, "2h01m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def _update(u: int, **kw) -> dict:
    return {"kind": "update", "update": u, "trainer_idle_ratio": u / 100, "lag_mean": u / 10, "lag_max": u, **kw}


def test_status_from_records_sync_and_async():
    sync = [{"kind": "stage", "stage": 0, "groups": 32, "response_tokens": 900}, _update(1, t_wall_s=5.0),
            _update(2, t_wall_s=6.0)]  # fmt: skip
    s = status_from_records(sync, "r", "sync", 4, 16)
    assert (s.updates, s.served, s.generated, s.tokens, s.queue_depth, s.state) == (2, 8, 32, 900, None, "running")
    assert (s.idle_ratio, s.lag_mean, s.lag_max, s.t_wall_s) == (0.02, 0.2, 2, 6.0)
    async_ = [_update(1, queue_depth=3, dropped=0, group_uids=["a", "b"]),
              _update(2, queue_depth=1, dropped=1, group_uids=["c", "d"]),
              {"kind": "end", "T_total": 9.0, "generated": 7, "served": 4, "dropped": 1}]  # fmt: skip
    a = status_from_records(async_, "r", "async", 2, 2)
    assert (a.updates, a.queue_depth, a.dropped, a.served, a.generated, a.state, a.t_wall_s) == (
        2, 1, 1, 4, 7, "finished", 9.0)  # fmt: skip


def test_load_status_prefers_status_json_and_sees_the_end(tmp_path):
    assert load_status(tmp_path) is None
    (tmp_path / "config.yaml").write_text("run: {name: cfgname}\nschedule: {mode: sync, groups_per_update: 4, "
                                          "total_updates: 8}\n")  # fmt: skip
    lines = [json.dumps(_update(1)), json.dumps(_update(2)), '{"kind": "upd']  # the last line is being written
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    s = load_status(tmp_path)
    assert (s.run, s.mode, s.updates, s.served, s.total_updates, s.state) == ("cfgname", "sync", 2, 8, 8, "running")
    write_status(tmp_path, _status(updates=7))
    assert load_status(tmp_path).updates == 7  # status.json wins
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "end"}) + "\n")
    assert load_status(tmp_path).state == "finished"  # an end record ends it even if status.json lags
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    assert RunStatus.from_dict({**asdict(_status()), "newer_key": 1}) == _status()


def test_board_says_its_first_line_when_it_starts_not_a_period_later(tmp_path):
    lines = []
    board = StatusBoard(_status(), tmp_path, 60.0, lines.append, lambda: 1.0)
    board.start()
    deadline = time.monotonic() + 5
    while not lines and time.monotonic() < deadline:
        time.sleep(0.01)
    board.stop("finished")  # a run shorter than one period still shows a line while it ran
    assert len(lines) == 2 and not lines[0].endswith("finished") and lines[1].endswith("finished")


def test_board_ticks_logs_writes_and_reports_changes(tmp_path):
    lines, changes = [], []
    board = StatusBoard(_status(mode="sync"), tmp_path, 0.05, lines.append, lambda: 12.0, changes.append)
    board.add(generated=32, tokens=1000)
    board.observe_update(_update(1))
    assert [c.generated for c in changes] == [32, 32] and changes[-1].served == 4  # sync: updates x B_mini
    board.start()
    deadline = time.monotonic() + 10
    while len(lines) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    board.stop("finished")
    board.stop("stopped")  # a close after finish changes nothing
    assert len(lines) >= 3 and lines[-1].endswith("12s finished")
    assert lines[0] == "r1 [sync] update 1/16 | idle 0.010 | lag 0.10 (max 1) | groups generated 32 served 4 " \
                       "dropped 0 | 12s"  # fmt: skip
    written = json.loads((tmp_path / STATUS_FILE).read_text())
    assert written["state"] == "finished" and written["tokens"] == 1000 and written["every_s"] == 0.05
    with pytest.raises(ValueError, match="state 'done'"):
        StatusBoard(_status(), tmp_path, 0, print, float).stop("done")


def test_board_async_counts_come_from_the_queue(tmp_path):
    board = StatusBoard(_status(), tmp_path, 0, lambda line: None, lambda: 1.0)
    board.set_queue({"put": 9, "served": 4, "dropped": 1, "queue_depth": 3, "tokens": 500})
    board.observe_update(_update(1, queue_depth=2, dropped=0, group_uids=["a", "b", "c", "d"]))
    s = board.snapshot()
    assert (s.generated, s.served, s.dropped, s.queue_depth, s.tokens, s.updates) == (9, 4, 1, 3, 500, 1)
    board.stop("stopped")
    assert not (tmp_path / STATUS_FILE).exists()  # every_s = 0: no status file, no line


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_watch_follows_a_run_until_it_ends(tmp_path):
    def writer() -> None:
        for u in (1, 2, 3):
            write_status(tmp_path, _status(updates=u, written_at=time.time(), every_s=1))
            time.sleep(0.15)
        write_status(tmp_path, _status(updates=4, state="stopped"))

    out = io.StringIO()
    thread = threading.Thread(target=writer)
    thread.start()
    code = watch_cli.watch(tmp_path, 0.02, out, max_wait_s=20)
    thread.join()
    shown = out.getvalue().splitlines()
    assert code == 3 and shown[-1].startswith("r1 [async] update 4/16") and shown[-1].endswith("stopped")
    assert len(shown) == len(set(shown)) >= 2  # a pipe gets one line per change, none repeated
    tty = _Tty()
    assert watch_cli.watch(tmp_path, 0.02, tty) == 3
    assert tty.getvalue() == "\x1b[J" + format_status(load_status(tmp_path)) + "\n"


def test_watch_redraws_in_place_and_notes_silence(tmp_path):
    assert watch_cli.redraw(["a", "b"], 0) == "\x1b[Ja\nb\n"
    assert watch_cli.redraw(["c"], 2) == "\x1b[2F\x1b[Jc\n"
    old = _status(updates=1, written_at=1000.0, every_s=10)
    assert watch_cli.describe(old, tmp_path, 1030.0)[1] == "written 30s ago"
    assert "no news since" in watch_cli.describe(old, tmp_path, 1100.0)[1]
    assert "waiting for the run" in watch_cli.describe(None, tmp_path, 0)[0]
    assert watch_cli.watch(tmp_path, 0.01, io.StringIO(), max_wait_s=0.05) == 1  # nothing there: gives up


def test_watch_once_cli(tmp_path, capsys):
    assert watch_cli.main([str(tmp_path), "--once"]) == 1
    write_status(tmp_path, _status(updates=5, state="finished"))
    assert watch_cli.main([str(tmp_path), "--once"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == format_status(_status(updates=5, state="finished"))
    assert watch_cli.main([str(tmp_path)]) == 0  # a finished run: the live view exits at once
    with pytest.raises(SystemExit):
        watch_cli.main([str(tmp_path), "--every", "0"])
