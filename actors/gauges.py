"""``ray.util.metrics`` gauges: every name, once, and who sets it. Exported as ``mugrpo_<name>{run=<run.name>}``.

Trainer rank 0 sets :data:`TRAINER_GAUGES` after every update, the async sample queue :data:`QUEUE_GAUGES`, and the
driver :data:`DRIVER_GAUGES` from its status board (:class:`mugrpo_async.reporting.status.StatusBoard`). The
Grafana dashboard (``monitoring/``) queries these names; cumulative counts are plotted as rates.
"""

from __future__ import annotations

from collections.abc import Callable

TRAINER_GAUGES = {
    "trainer_idle_ratio": "cumulative wait / wall", "lag_mean": "mean update - policy version",
    "lag_max": "max update - policy version", "trainer_updates": "optimizer updates done",
    "nonfinite_skipped": "updates skipped for a non-finite loss or gradient",
    "mismatch_kl": "train/inference mismatch: k3 KL(engine || trainer) per token, lag-0 rows",
    "mismatch_logprob_abs_max": "train/inference mismatch: max |log pi_trainer - log pi_engine|, lag-0 rows",
}  # fmt: skip
QUEUE_GAUGES = {
    "queue_depth": "finished groups waiting", "queue_dropped": "groups over the lag cap",
    "queue_filtered": "equal-reward groups filtered (rollout.dynamic_sampling)",
    "policy_version": "latest published policy version",
}  # fmt: skip
DRIVER_GAUGES = {
    "groups_generated": "groups generated so far (async: put into the queue)",
    "groups_served": "groups served to the trainer so far",
    "rollout_tokens": "response tokens generated so far",
}  # fmt: skip
ALL_GAUGES = {**TRAINER_GAUGES, **QUEUE_GAUGES, **DRIVER_GAUGES}


def make_gauges(descriptions: dict[str, str], run_name: str) -> dict:
    """One Gauge per ``{name: description}``, with the default tag ``run=<run_name>``."""
    from ray.util.metrics import Gauge

    return {
        name: Gauge(f"mugrpo_{name}", description=desc, tag_keys=("run",)).set_default_tags({"run": run_name})
        for name, desc in descriptions.items()
    }


def driver_gauges(run_name: str) -> Callable:
    """A status board's ``on_change``: sets :data:`DRIVER_GAUGES` from a ``RunStatus``."""
    gauges = make_gauges(DRIVER_GAUGES, run_name)

    def on_change(status) -> None:
        gauges["groups_generated"].set(status.generated)
        gauges["groups_served"].set(status.served)
        gauges["rollout_tokens"].set(status.tokens)

    return on_change
