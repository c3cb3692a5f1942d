"""The trainer's pure parts: padding and log-probs, the minibatch split and its totals, one rank's update, the
non-finite guard, the idle clock, the due-rules of the update loop, weight packing, what the ranks share.
"""
