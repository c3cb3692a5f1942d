"""The Grafana dashboard of mugrpo-async runs, built from the gauge registry (``actors/gauges.py``).

    python -m monitoring.dashboard                  # rewrites monitoring/grafana/mugrpo_dashboard.json

One row per run (the ``run`` tag of every ``mugrpo_*`` gauge, a template variable; the row repeats for each
selected run): trainer idle ratio, lag mean and max, queue depth and drops, policy version, updates and groups
per second, rollout tokens per second, the train/inference mismatch. Ray exports application metrics with its
``ray_`` prefix, so the queries name ``ray_mugrpo_<gauge>``; a gauge has one series per process that set it
(tags ``WorkerId``, ``NodeAddress``, ...), so each query takes the max over them by run. Cumulative counts are
plotted with ``rate``. The file is a plain dashboard model: Grafana's file provisioning (what Ray sets up under
``<session>/metrics/grafana``) and Grafana's Import both take it; the data source is a variable.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from actors.gauges import ALL_GAUGES

PREFIX = "ray_mugrpo_"  # Ray's prefix + ours
OUT = Path(__file__).resolve().parent / "grafana" / "mugrpo_dashboard.json"
UID = "mugrpo-async-runs"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RUN_FILTER = 'run=~"$run"'


def gauge(name: str) -> str:
    """The run's latest value of gauge ``name``, one series per run."""
    if name not in ALL_GAUGES:
        raise KeyError(f"{name}: not a gauge of actors/gauges.py ({sorted(ALL_GAUGES)})")
    return f"max by (run) ({PREFIX}{name}{{{RUN_FILTER}}})"


def per_second(name: str) -> str:
    """The run's rate of the cumulative gauge ``name``, per second."""
    if name not in ALL_GAUGES:
        raise KeyError(f"{name}: not a gauge of actors/gauges.py ({sorted(ALL_GAUGES)})")
    return f"max by (run) (rate({PREFIX}{name}{{{RUN_FILTER}}}[$__rate_interval]))"


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)


PANELS = (
    Panel("Trainer idle ratio", "Cumulative wait for samples / cumulative trainer wall time (trainer_idle_ratio).",
          "percentunit", ((gauge("trainer_idle_ratio"), "idle ratio"),)),
    Panel("Lag (update - policy version)", "Staleness of the newest minibatch: mean and max over its rows.", "short",
          ((gauge("lag_mean"), "mean"), (gauge("lag_max"), "max"))),
    Panel("Sample queue (async)", "Finished groups waiting in the sample queue; groups dropped over the lag cap.",
          "short", ((gauge("queue_depth"), "depth"), (gauge("queue_dropped"), "dropped (total)"),
                     (gauge("queue_filtered"), "filtered, equal rewards (total)"))),
    Panel("Policy version (async)", "Newest policy version published on the queue's weights board.", "short",
          ((gauge("policy_version"), "published"),)),
    Panel("Updates and groups per second", "Optimizer updates, groups generated and groups served, per second.",
          "short", ((per_second("trainer_updates"), "updates/s"), (per_second("groups_generated"), "generated/s"),
                    (per_second("groups_served"), "served/s"))),
    Panel("Rollout tokens per second", "Response tokens generated per second.", "short",
          ((per_second("rollout_tokens"), "tokens/s"),)),
    Panel("Train/inference mismatch (lag-0 rows)", "k3 KL(engine || trainer) per token and max |log-prob gap|.",
          "short", ((gauge("mismatch_kl"), "KL"), (gauge("mismatch_logprob_abs_max"), "max |d logp|"))),
)  # fmt: skip


def _panel(p: Panel, pid: int, x: int, y: int) -> dict:
    targets = [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                "range": True, "instant": False, "editorMode": "code"}
               for i, (expr, legend) in enumerate(p.targets)]  # fmt: skip
    return {
        "type": "timeseries", "id": pid, "title": p.title, "description": p.description, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y}, "targets": targets,
        "fieldConfig": {"defaults": {"unit": p.unit, "custom": {"lineWidth": 1, "fillOpacity": 10,
                                                                "showPoints": "never", "spanNulls": True}},
                        "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
    }  # fmt: skip


def _variables() -> list[dict]:
    runs = f"label_values({PREFIX}trainer_updates, run)"
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus", "hide": 0,
         "current": {}, "options": [], "refresh": 1, "regex": ""},
        {"name": "run", "label": "run", "type": "query", "datasource": DATASOURCE, "definition": runs,
         "query": {"query": runs, "refId": "runs"}, "refresh": 2, "multi": True, "includeAll": True,
         "allValue": ".+", "current": {}, "options": [], "sort": 1, "hide": 0, "regex": ""},
    ]  # fmt: skip


def build() -> dict:
    """The dashboard model: a row repeated per run, holding every panel of :data:`PANELS`."""
    panels = [{"type": "row", "id": 1, "title": "run $run", "repeat": "run", "collapsed": False, "panels": [],
               "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0}}]  # fmt: skip
    for i, p in enumerate(PANELS):
        panels.append(_panel(p, i + 2, 8 * (i % 3), 1 + 8 * (i // 3)))
    return {
        "id": None, "uid": UID, "title": "mugrpo-async runs", "tags": ["mugrpo-async", "ray"], "editable": True,
        "schemaVersion": 39, "version": 1, "graphTooltip": 1, "refresh": "10s", "timezone": "",
        "time": {"from": "now-1h", "to": "now"}, "annotations": {"list": []}, "links": [],
        "templating": {"list": _variables()}, "panels": panels,
    }  # fmt: skip


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """Every (panel title, PromQL) of a dashboard model, rows excluded."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def resolve(expr: str, run: str, rate_interval: str) -> str:
    """A panel's PromQL as Grafana sends it for one ``run``: ``$run`` replaced as Grafana does for a multi-value
    variable (regex characters escaped inside the PromQL string) and ``$__rate_interval`` replaced."""
    value = re.sub(r"([\\$^*{}\[\]'+?.()|])", r"\\\\\1", run)
    return expr.replace("$run", value).replace("$__rate_interval", rate_interval)


def main() -> None:
    OUT.write_text(json.dumps(build(), indent=2) + "\n")
    print(OUT)


if __name__ == "__main__":
    main()
