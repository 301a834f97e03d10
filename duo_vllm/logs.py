"""duo_vllm's log lines in vLLM's format: under vLLM's logger (``vllm.duo_vllm.*``) in
vLLM's processes, and through :func:`setup_actor_logging` in the draft actor, which
does not load vLLM (else Python would drop the info lines)."""

from __future__ import annotations

import logging

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
    handler.setFormatter(logging.Formatter(
        "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s", "%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
