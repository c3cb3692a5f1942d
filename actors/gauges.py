"""``ray.util.metrics`` gauges shared by the actors: named ``mugrpo_<name>``, tagged with the run."""

from __future__ import annotations


def make_gauges(descriptions: dict[str, str], run_name: str) -> dict:
    """One Gauge per ``{name: description}``, with the default tag ``run=<run_name>``."""
    from ray.util.metrics import Gauge

    return {
        name: Gauge(f"mugrpo_{name}", description=desc, tag_keys=("run",)).set_default_tags({"run": run_name})
        for name, desc in descriptions.items()
    }
