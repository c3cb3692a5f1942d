"""Rewards: the boxed-answer math reward (math-verify), and the memo of scored answers that the scorer actors serve."""
