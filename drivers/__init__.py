"""The driver loops on Ray: set-up and the Run object, the staged and the asynchronous loop, their shared
pipelining, fault-tolerant generation, periodic evaluation, and how a run stops."""
