"""Which model a study seed began with, and which stage its replaying runs trained on, so that the arms a claim
pairs within a seed always trained the same model on the same rollouts.

A model built in code is rebuilt on each machine, and a rebuild on a CPU with other vector instructions need not give
the same weights (floating-point sums in another order, compounded over thousands of warm-start steps). A study
therefore records, with each seed's untrained evaluation (``initial/seed-<s>.json``), the digest of the weights it
scored (``model_sha256``), and refuses to continue the seed on weights with another digest. A record from before
digests is checked by its scores instead: the same seeded evaluation of the same weights on the same kind of machine
gives the same responses, so equal summaries mean the same model, and the digest is then recorded.

A fixed rollout set (``--replay-from``) is not exported (tens of MB per seed), so a seed's stage can be lost with a
machine and generated again elsewhere. Whether a run trained on the stage its seed's other runs trained on is read
from the runs themselves (:func:`stage_mismatches`), and a run that did not is left out of the claims.
"""

from __future__ import annotations

from collections.abc import Collection

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


TRACE_KEYS = ("num_tokens", "reward_mean")
"""Per update, what a run's minibatch held: with a fixed rollout set, the same stage in the same order gives the same
values in every arm (the policy being trained changes neither), so the sequence over a run is the stage's trace."""


def stage_trace(updates: list[dict]) -> list[tuple]:
    """The :data:`TRACE_KEYS` values of each update record, in update order."""
    return [tuple(u.get(k) for k in TRACE_KEYS) for u in updates]


def stage_parting(reference: list[tuple], trace: list[tuple]) -> str | None:
    """The first update at which ``trace`` parts from ``reference`` (over the updates both have), or None."""
    for i, (want, got) in enumerate(zip(reference, trace, strict=False)):
        if want != got:
            return f"update {i + 1}: {dict(zip(TRACE_KEYS, got))} against {dict(zip(TRACE_KEYS, want))}"
    return None


def stage_mismatches(runs: list, sources: Collection[tuple[str, int]] = ()) -> dict[tuple[str, int], str | None]:
    """Runs of a fixed-rollout-set study that did not train on their seed's stage.

    ``runs``: :class:`~mugrpo_async.reporting.study.RunData`. ``sources``: the ``(variant, seed)`` of the runs among
    them that generated their seed's stage. Runs of one seed with the same ``schedule.groups_per_update`` and
    ``schedule.mu`` draw the same minibatches in the same order, so each is compared with the seed's source where that
    is one of them, else with the first; other batch sizes draw other minibatches and form their own group. Where a
    group holds no source and its runs disagree, nothing tells which stage is the seed's, so every run of the group is
    named. A stage regenerated on another machine passes only if it gave every minibatch the same token count and
    reward. Equal traces are a fingerprint, not a proof: two stages could share them by chance, which 1,024
    minibatches make unlikely. Returns ``{(variant, seed): why, or None where it matched}`` for every run compared
    (a group's reference is compared only when it is named).
    """
    groups: dict[tuple, list] = {}
    for r in runs:
        schedule = r.config.get("schedule", {})
        groups.setdefault((r.seed, schedule.get("groups_per_update"), schedule.get("mu")), []).append(r)
    out = {}
    for (seed, b_mini, _), members in groups.items():
        known = [r for r in members if (r.variant, r.seed) in sources]
        ref = (known or members)[0]
        reference = stage_trace(ref.updates)
        partings = {(r.variant, r.seed): stage_parting(reference, stage_trace(r.updates))
                    for r in members if r is not ref}  # fmt: skip
        if known or not any(partings.values()):
            out |= {(v, s): f"{v} seed {s} trained on another stage than {ref.variant} ({why})" if why else None
                    for (v, s), why in partings.items()}  # fmt: skip
            continue
        (v, _), why = next((k, w) for k, w in partings.items() if w)
        named = f"seed {seed}'s runs at B_mini {b_mini} trained on different stages ({v} against {ref.variant}, {why})"
        out |= dict.fromkeys([(ref.variant, ref.seed), *partings], f"{named}, and its source is not here to tell which")
    return out
