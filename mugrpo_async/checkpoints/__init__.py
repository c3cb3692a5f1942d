"""Checkpoints without pickle: HF model folders, a rank's optimizer and RNG state, the sealed checkpoint store and
resuming.
"""
