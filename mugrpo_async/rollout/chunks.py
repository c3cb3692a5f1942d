"""The chunk plan of a sync stage: how many groups go into one generation call (and one shard).

A stage's B_train prompts are cut into ``num_chunks`` chunks of ``chunk_size`` groups (the last may be
smaller); each chunk is one call on one rollout worker and one shard of ``rollouts/stage-K/``, written as
it returns. Chunks are the unit of fault recovery (a lost chunk is generated again) and of load balance
(a free worker takes the next chunk), so a chunk must be bounded in work, not only in groups: at paper
scale a group is up to G x max_new_tokens = 8 x 8192 response tokens, and two chunks per worker of a
32,768-group stage would be calls of 4,096 groups (268M tokens at most) each.

The size, in order of precedence:

1. ``rollout.chunk_groups`` when set (an explicit override);
2. ``rollout.chunk_tokens`` when set: ``chunk_tokens // (G x max_new_tokens)`` groups, at least 1, and at
   most the default below (so that every worker still gets work in a small stage);
3. the default: two calls per worker, ``ceil(B_train / (2 x num_workers))``.

The plan is stored in the stage's manifest; a stage folder begun earlier keeps its own plan whatever the
config says now (:func:`plan_for_stage`). Ray-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkPlan:
    """``num_chunks`` chunks of ``chunk_size`` groups (the last may be smaller) covering a stage's prompts."""

    chunk_size: int
    num_chunks: int

    def chunk(self, items: list, c: int) -> list:
        """Chunk ``c`` of ``items`` (the stage's prompts, in order)."""
        return items[c * self.chunk_size : (c + 1) * self.chunk_size]


def chunk_plan(num_groups: int, num_workers: int, group_size: int, max_new_tokens: int, chunk_groups: int = 0,
               chunk_tokens: int = 0) -> ChunkPlan:  # fmt: skip
    """The plan for a new stage of ``num_groups`` groups (see the module docstring for the rule).

    Args:
        num_groups: B_train, the stage's prompts (>= 1).
        num_workers: rollout workers (>= 1).
        group_size: G, responses per prompt.
        max_new_tokens: response limit in tokens.
        chunk_groups: ``rollout.chunk_groups`` (0: unset).
        chunk_tokens: ``rollout.chunk_tokens`` (0: unset).
    """
    if num_groups < 1:
        raise ValueError(f"a stage has at least one group, got {num_groups}")
    default = max(1, -(-num_groups // (2 * max(num_workers, 1))))
    if chunk_groups:
        size = chunk_groups
    elif chunk_tokens:
        size = min(default, max(1, chunk_tokens // (group_size * max_new_tokens)))
    else:
        size = default
    size = min(size, num_groups)
    return ChunkPlan(size, -(-num_groups // size))


def plan_for_stage(stored: dict | None, new: ChunkPlan) -> ChunkPlan:
    """The plan of a stage folder: the one its manifest holds (``stored``, ``{"chunk_size", "num_chunks"}``)
    when it was begun earlier, else ``new``."""
    if stored and stored.get("chunk_size") and stored.get("num_chunks"):
        return ChunkPlan(int(stored["chunk_size"]), int(stored["num_chunks"]))
    return new
