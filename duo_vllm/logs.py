"""Where duo_vllm's log lines go: vLLM's logger format, in vLLM's processes and the actor's.

In vLLM's processes our loggers hang under vLLM's (``vllm.duo_vllm.*``), so
vLLM's handler and format apply. The draft actor (a Ray worker) does not load
vLLM; :func:`setup_actor_logging` gives the ``duo_vllm`` loggers there a handler
of the same format (Ray prefixes each line with the actor's name and pid).
Without either, Python prints bare warnings and drops the info lines.
"""

from __future__ import annotations

import logging

FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def vllm_logger(name: str) -> logging.Logger:
    """A logger under vLLM's (for code that runs in vLLM's processes)."""
    try:
        from vllm.logger import init_logger
    except ImportError:
        return logging.getLogger(name)
    return init_logger(f"vllm.{name}")


def setup_actor_logging(level: int = logging.INFO) -> None:
    """One stderr handler in vLLM's format for the ``duo_vllm`` loggers of this process,
    unless they already have one (idempotent; the root logger is left alone)."""
    root = logging.getLogger("duo_vllm")
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
