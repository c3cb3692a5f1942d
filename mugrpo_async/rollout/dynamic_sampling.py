"""DAPO's dynamic sampling for a sync stage (Yu et al. 2025, arXiv:2503.14476): keep only informative groups.

A group whose G rewards are all equal has advantages of exactly 0 and adds no gradient; with
``rollout.dynamic_sampling`` such groups are filtered out of the stage and more prompts generated, round after
round (at most ``rollout.max_refill_rounds``), until the stage holds its B_train informative groups. A stage still
short after the last round is filled up with filtered groups (zero advantages: they add nothing but keep every
update at B_mini groups), and the shortfall is counted. Pure Python, no Ray; the driver is `drivers.sync`.

Async mode (:class:`VersionBound`, used by the sample queue's `staleness.LagQueue`): an equal-reward group is
filtered when it is put into the queue, never served and not counted against the lag budget, so the workers keep
generating (the refill). At most ``(1 + max_refill_rounds) * B_mini`` groups of one policy version are generated
before its equal-reward groups are queued as they are (counted ``groups_short``, logged once per version): a task
where nothing is informative still trains.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from mugrpo_async.rollout.samples import Group

log = logging.getLogger(__name__)


def informative(group: Group) -> bool:
    """Whether the group's rewards are not all equal (the equal-reward rule of `algo.nonconstant_groups`)."""
    return any(r != group.rewards[0] for r in group.rewards)


def refill_size(target: int, kept: int, generated: int) -> int:
    """Prompts to generate in the next round: the groups still needed, scaled by the informative share seen so far.

    Args:
        target: B_train, informative groups the stage needs.
        kept: informative groups so far.
        generated: groups generated so far (>= kept).

    Returns:
        ceil((target - kept) / (kept / generated)), at most ``target`` (and ``target`` when nothing was kept yet);
        0 when the stage is full.
    """
    need = target - kept
    if need <= 0:
        return 0
    if kept == 0:
        return target
    return min(target, math.ceil(need * generated / kept))


@dataclass
class StageFilter:
    """The groups of a stage under dynamic sampling, round by round.

    Attributes:
        target: B_train.
        kept: informative groups, in generation order.
        filtered: groups with all rewards equal, in generation order.
        rounds: refill rounds added so far (the stage's first generation not counted).
    """

    target: int
    kept: list[Group] = field(default_factory=list)
    filtered: list[Group] = field(default_factory=list)
    rounds: int = 0

    def add(self, groups: list[Group]) -> None:
        """One round's groups, split into kept and filtered."""
        for g in groups:
            (self.kept if informative(g) else self.filtered).append(g)

    @property
    def generated(self) -> int:
        return len(self.kept) + len(self.filtered)

    def next_round(self, max_rounds: int) -> int:
        """Prompts the next refill round generates (0: the stage is full, or the bound is reached)."""
        if self.rounds >= max_rounds:
            return 0
        return refill_size(self.target, len(self.kept), self.generated)

    def stage(self) -> tuple[list[Group], dict]:
        """The stage's ``target`` groups (informative first, then filtered ones to fill a shortfall) and its counts:
        ``groups_generated``, ``groups_filtered``, ``refill_rounds``, ``groups_short``."""
        short = max(self.target - len(self.kept), 0)
        groups = self.kept[: self.target] + self.filtered[:short]
        stats = {"groups_generated": self.generated, "groups_filtered": len(self.filtered),
                 "refill_rounds": self.rounds, "groups_short": short}  # fmt: skip
        return groups, stats


@dataclass
class VersionBound:
    """Async mode: the equal-reward filter at the sample queue, bounded per policy version.

    Attributes:
        limit: groups of one version generated (informative or not) up to which equal-reward groups are filtered:
            ``(1 + max_refill_rounds) * B_mini``; past it they are queued as they are (``short``).
        generated: groups put so far per policy version (versions that can no longer be served are forgotten).
        filtered: equal-reward groups filtered, ever.
        short: equal-reward groups queued past the bound, ever.
        short_by: those per policy version (forgotten with ``generated``).
    """

    limit: int
    generated: dict[int, int] = field(default_factory=dict)
    filtered: int = 0
    short: int = 0
    short_by: dict[int, int] = field(default_factory=dict)

    def admit(self, version: int, informative: bool) -> bool:
        """Count one group of ``version`` put into the queue; whether it is queued (False: filtered)."""
        n = self.generated[version] = self.generated.get(version, 0) + 1
        if informative:
            return True
        if n <= self.limit:
            self.filtered += 1
            return False
        if version not in self.short_by:
            log.warning("policy version %d generated its %d groups ((1 + rollout.max_refill_rounds) x B_mini); "
                        "its equal-reward groups are now served as they are (groups_short)",
                        version, self.limit)  # fmt: skip
        self.short_by[version] = self.short_by.get(version, 0) + 1
        self.short += 1
        return True

    def forget_before(self, version: int) -> None:
        """Drop the counts of versions older than ``version`` (their groups can no longer be served)."""
        for v in [v for v in self.generated if v < version]:
            del self.generated[v]
            self.short_by.pop(v, None)

    def state(self) -> list[list[int]]:
        """``[[version, generated, short], ...]``, JSON-safe (a checkpoint's queue snapshot)."""
        return [[v, n, self.short_by.get(v, 0)] for v, n in sorted(self.generated.items())]

    def load(self, state: list[list[int]], filtered: int, short: int) -> None:
        """Inverse of :meth:`state`, with the run's totals."""
        self.generated = {int(v): int(n) for v, n, _ in state}
        self.short_by = {int(v): int(k) for v, _, k in state if k}
        self.filtered, self.short = filtered, short
