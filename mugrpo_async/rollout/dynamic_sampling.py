"""DAPO's dynamic sampling for a sync stage (Yu et al. 2025, arXiv:2503.14476): keep only informative groups.

A group whose G rewards are all equal has advantages of exactly 0 and adds no gradient; with
``rollout.dynamic_sampling`` such groups are filtered out of the stage and more prompts generated, round after
round (at most ``rollout.max_refill_rounds``), until the stage holds its B_train informative groups. A stage still
short after the last round is filled up with filtered groups (zero advantages: they add nothing but keep every
update at B_mini groups), and the shortfall is counted. Pure Python, no Ray; the driver is `drivers.sync`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mugrpo_async.rollout.samples import Group


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
