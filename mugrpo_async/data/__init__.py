"""Prompts: the synthetic task, file loaders (JSONL, JSON, Parquet) and their row formats, prompt templates, the prompt
pool and its seeded stream.
"""
