"""Benchmark 7, scaling: how staged mu-GRPO's T_total grows with total updates, with mu and with response length.

Axes (tiny config, B_mini = 16; the point shared with benchmark 1 is its mu-GRPO run):
- total updates U in {32, 64, 128} at mu = 32: the method says T grows linearly in U (U / mu stages of
  equal cost);
- mu in {8, 32, 128} at U = 128: U / mu stages, so T should be linear in the number of stages (1 / mu),
  the per-stage fixed cost being the slope;
- rollout.max_new_tokens in {8, 16, 32}: T should be linear in the response tokens generated. The
  tiny model stops at its answer (~10 tokens, so a cap changes little but the padding of the few
  responses that run on), so this axis uses benchmark 3's 4M-parameter Qwen2 with random weights,
  whose responses run to the cap: U = 16, mu = 4 (4 stages).
For each axis a least-squares line of T_run (T_total without start-up) against the axis' linear
variable, with its R^2.

    .venv/bin/python -m bench.run --only 7 [--smoke]
"""

from __future__ import annotations

from bench import staging
from bench.common import REPO, Row, Section, TrainRun, bench_command, md_table, train

FULL_AXES = {"updates": [32, 64, 128], "mu": [8, 32, 128], "max_new_tokens": [8, 16, 32]}
LENGTH_MODEL, LENGTH_UPDATES, LENGTH_MU = "qwen2-4m", 16, 4  # the response-length axis (see above)
SMOKE_AXES = {"mu": [1, 4]}  # the smoke version fits benchmark 1's two smoke runs (GRPO mu=1, mu-GRPO mu=4)


def point(smoke: bool, axis: str, value: int) -> TrainRun:
    """One run of an axis; the axis' base point is benchmark 1's mu-GRPO run (same overrides, reused)."""
    p = staging.SMOKE if smoke else staging.FULL
    if smoke:
        return staging.runs(smoke)[0 if value == p["grpo_mu"] else 1]
    updates, mu, extra = p["updates"], p["mu_grpo_mu"], []
    if axis == "updates":
        updates, mu = value, min(mu, value)
    elif axis == "mu":
        mu = value
    else:
        from bench.weight_sync import model_folder

        updates, mu = LENGTH_UPDATES, LENGTH_MU
        extra = [f"model.path={model_folder(LENGTH_MODEL).relative_to(REPO)}", f"rollout.max_new_tokens={value}"]
    common = [f"schedule.total_updates={updates}", f"schedule.groups_per_update={p['b_mini']}"]
    return train([*common, "algo.name=mu_grpo", f"schedule.mu={mu}", *extra])


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """(slope, intercept, R^2) of the least-squares line y = slope * x + intercept."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys))
    return slope, intercept, 1 - ss_res / ss_tot if ss_tot else 1.0


def _linear_variable(axis: str, run: TrainRun) -> float:
    if axis == "updates":
        return len(run.updates)
    if axis == "mu":
        return len(run.stages)  # U / mu
    return sum(s["response_tokens"] for s in run.stages)


UNITS = {
    "updates": ("updates U", "s per update"),
    "mu": ("stages U / mu", "s per stage"),
    "max_new_tokens": (f"response tokens, {LENGTH_MODEL}", "s per 1k tokens"),
}


def run(smoke: bool) -> Section:
    staging.runs(smoke)  # the shared base point first, so that it is measured beside benchmark 1
    axes = SMOKE_AXES if smoke else FULL_AXES
    cmd = bench_command(7, smoke)
    sec = Section(7, "Scaling: T_total against total updates, mu and response length")
    for axis, values in axes.items():
        runs = [point(smoke, axis, v) for v in values]
        xs = [_linear_variable(axis, r) for r in runs]
        ys = [r.t_run for r in runs]
        slope, icpt, r2 = linear_fit(xs, ys)
        scale = 1000 if axis == "max_new_tokens" else 1
        var, unit = UNITS[axis]
        dev = max(abs(y - slope * x - icpt) for x, y in zip(xs, ys)) / (sum(ys) / len(ys))
        spread = (slope * (max(xs) - min(xs))) / (sum(ys) / len(ys))
        sec.rows.append(
            Row(f"T_run linear in {var} (axis {axis} = {values})",
                "linear where the method says so (every point within 10% of the line)",
                f"{slope * scale:.2f} {unit} + {icpt:.1f} s; worst point {dev:.0%} off, R^2 {r2:.2f}",
                dev <= 0.10 if len(xs) > 2 else None, cmd,
                f"the line itself moves T_run by only {spread:.0%} across the axis, less than the run-to-run "
                "spread of single runs on the shared 2 cores (the first stage's cold engine alone varies by seconds)")
        )  # fmt: skip
        table = [
            [
                v,
                f"{x:g}",
                f"{r.end['T_total']:.1f}",
                f"{r.t_run:.1f}",
                f"{r.end['T_rollout']:.1f}",
                f"{r.end['T_train']:.1f}",
                f"{slope * x + icpt:.1f}",
            ]
            for v, x, r in zip(values, xs, runs)
        ]
        sec.details += [
            f"Axis `{axis}` (linear variable: {var}):",
            md_table([axis, var, "T_total s", "T_run s", "T_rollout s", "T_train s", "fit s"], table),
            "Runs: " + "; ".join(f"`{r.cmd}`" for r in runs),
        ]
        sec.data[axis] = {"values": values, "x": xs, "T_run": ys, "fit": (slope, icpt, r2)}
    return sec
