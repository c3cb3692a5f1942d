"""Models: loading the policy as configured, the tiny model built in code, GGUF to HF conversion."""
