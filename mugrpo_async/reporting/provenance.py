"""Which model a study seed began with, so that a seed's later runs never train another one.

A model built in code is rebuilt on each machine, and a rebuild on a CPU with other vector instructions need not give
the same weights (floating-point sums in another order, compounded over thousands of warm-start steps). A study
therefore records, with each seed's untrained evaluation (``initial/seed-<s>.json``), the digest of the weights it
scored (``model_sha256``), and refuses to continue the seed on weights with another digest. A record from before
digests is checked by its scores instead: the same seeded evaluation of the same weights on the same kind of machine
gives the same responses, so equal summaries mean the same model, and the digest is then recorded.
"""

from __future__ import annotations

SCORE_KEYS = ("pass@1", "format_rate", "mean_response_tokens")
"""The summaries of one benchmark that two evaluations of the same model must share exactly."""


def scores(result: dict) -> dict[str, tuple]:
    """Per benchmark of a ``launch.eval --out`` result, its :data:`SCORE_KEYS` values."""
    return {name: tuple(b.get(k) for k in SCORE_KEYS) for name, b in result.get("benchmarks", {}).items()}


def model_change(initial: dict, digest: str | None, rescored: dict | None = None) -> str | None:
    """Why the model now configured is not the one ``initial`` (a seed's untrained evaluation) scored; None if it is.

    ``digest``: the configured folder's :func:`~mugrpo_async.checkpoints.model_folder.weights_digest` (None for a hub
    name: nothing to compare). ``rescored``: the same evaluation of the configured model, needed only when ``initial``
    holds no digest (an older record); without it such a record cannot be checked and counts as a change.
    """
    recorded = initial.get("model_sha256")
    if digest is None or recorded == digest:
        return None
    if recorded is not None:
        return f"its weights have digest {digest[:12]}, the seed began on {recorded[:12]}"
    if rescored is None:
        return "no digest was recorded when the seed began, and the model could not be evaluated again to compare"
    before, now = scores(initial), scores(rescored)
    if before and before == now:
        return None
    named = {b: (dict(zip(SCORE_KEYS, before.get(b, ()))), dict(zip(SCORE_KEYS, now.get(b, ())))) for b in before | now}
    diff = "; ".join(f"{b}: {then} then, {new} now" for b, (then, new) in sorted(named.items()) if then != new)
    return f"its untrained evaluation differs from the one recorded when the seed began ({diff or 'no scores'})"
