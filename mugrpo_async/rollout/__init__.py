"""Rollout data: the sample schema (Group) and its msgpack codec, the on-disk stage shards, engine output turned into
groups, the engine's settings, and the async mode's bounded-lag queue logic.
"""
