"""What an actor's process prints: the project's own log lines, and third-party noise only at DEBUG.

Ray forwards every line an actor writes to the driver's terminal (``log_to_driver``), prefixed with the
actor's name. Below ``logging.level=DEBUG`` an actor process keeps the project's loggers (``actors``,
``drivers``, ``mugrpo_async``) at the configured level, in the driver's format, and hides the rest:
Python warnings (e.g. torch's ``reduce_op`` FutureWarning), and torch's, transformers' and DeepSpeed's
loggers below ERROR. vLLM's logger and C++ warnings are set by environment variables before the
process starts (:func:`mugrpo_async.rollout.engine.engine_env`), as vLLM configures its logger on import.
"""

from __future__ import annotations

import logging
import warnings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PROJECT_LOGGERS = ("actors", "drivers", "mugrpo_async")
THIRD_PARTY_LOGGERS = ("torch", "transformers", "DeepSpeed", "deepspeed", "vllm", "filelock", "urllib3")


def quiet_process(level: str) -> None:
    """Set up this actor process's logging and warnings for ``logging.level`` = ``level`` (see the module doc)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    for name in PROJECT_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not logger.handlers:
            logger.addHandler(handler)
        logger.propagate = False  # printed once, whatever handlers the root logger gets
    if level == "DEBUG":
        return
    warnings.filterwarnings("ignore")
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
