"""Unit: the Grafana dashboard file is the one `python -m monitoring.dashboard` builds, in the form Grafana takes.

Its queries run against a real Prometheus scraping a real `ray job submit` run in tests/test_jobs.py.
"""

from __future__ import annotations

import json
import re

from actors.gauges import ALL_GAUGES, DRIVER_GAUGES, QUEUE_GAUGES, TRAINER_GAUGES
from monitoring.dashboard import OUT, PANELS, build, queries, resolve

METRIC = re.compile(r"\b(ray_mugrpo_\w+)\{")


def test_committed_file_is_the_built_dashboard():
    assert json.loads(OUT.read_text()) == build(), "run: python -m monitoring.dashboard"


def test_every_panel_queries_a_known_gauge_of_the_selected_run():
    d = build()
    found = queries(d)
    assert len(found) == sum(len(p.targets) for p in PANELS) >= 10
    used = set()
    for title, expr in found:
        names = METRIC.findall(expr)
        assert names and all(n.removeprefix("ray_mugrpo_") in ALL_GAUGES for n in names), (title, expr)
        assert expr.count('run=~"$run"') == len(names) and expr.startswith("max by (run) ("), (title, expr)
        used |= {n.removeprefix("ray_mugrpo_") for n in names}
    # what a run is watched for: idle, lag, queue, drops, version, updates/s, groups/s, tokens/s, mismatch
    wanted = {"trainer_idle_ratio", "lag_mean", "lag_max", "queue_depth", "queue_dropped", "policy_version",
              "trainer_updates", "groups_generated", "rollout_tokens", "mismatch_kl",
              "mismatch_logprob_abs_max"}  # fmt: skip
    assert wanted <= used
    assert len(ALL_GAUGES) == len(TRAINER_GAUGES) + len(QUEUE_GAUGES) + len(DRIVER_GAUGES)  # no name twice


def test_grafana_form_one_row_per_run_and_a_datasource_variable():
    d = build()
    assert d["id"] is None and d["uid"] and isinstance(d["schemaVersion"], int)  # provisioning and import
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    run = variables["run"]
    assert run["type"] == "query" and run["multi"] and run["includeAll"]
    assert run["query"]["query"] == "label_values(ray_mugrpo_trainer_updates, run)"
    rows = [p for p in d["panels"] if p["type"] == "row"]
    assert len(rows) == 1 and rows[0]["repeat"] == "run" and "$run" in rows[0]["title"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        here = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & here, p["title"]  # panels do not overlap
        cells |= here
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])


def test_resolve_as_grafana_sends_a_query():
    expr = 'max by (run) (rate(ray_mugrpo_rollout_tokens{run=~"$run"}[$__rate_interval]))'
    assert resolve(expr, "jobs-async.1", "5s") == (
        'max by (run) (rate(ray_mugrpo_rollout_tokens{run=~"jobs-async\\\\.1"}[5s]))'
    )
