"""The draft actor: a llama.cpp drafter in its own process, pinned to CPU cores.

:class:`DraftWorker` is plain Python (used in-process when ``use_actor`` is
off, and in tests); :func:`get_or_create_actor` wraps it in a named Ray actor
in DuoProposer's namespace.
"""

from __future__ import annotations

import logging
import os
import time

from .config import DuoConfig, DuoConfigError, allowed_cpus
from .drafter import ChainDrafter

logger = logging.getLogger(__name__)


def pin_process(cores: list[int]) -> list[int]:
    """Pin the calling process to ``cores``; raise a readable error if impossible."""
    allowed = allowed_cpus()
    missing = [c for c in cores if c not in allowed]
    if missing:
        raise DuoConfigError(
            f"draft_cores {cores} name CPU(s) {missing} that do not exist on this node "
            f"(allowed CPUs: {allowed})"
        )
    os.sched_setaffinity(0, cores)
    return sorted(os.sched_getaffinity(0))


class DraftWorker:
    """Loads the draft model and drafts for batches of contexts."""

    def __init__(self, cfg: dict, model_path: str, cores: list[int] | None,
                 backend_factory=None):
        config = DuoConfig.from_dict(cfg)
        self.cores = pin_process(cores) if cores else sorted(os.sched_getaffinity(0))
        n_threads = config.n_threads or len(self.cores)
        if backend_factory is None:
            from .backends.llama_cpp import LlamaCppBackend

            backend = LlamaCppBackend(model_path, n_ctx_per_seq=config.n_ctx,
                                      n_seq=config.max_sequences, n_threads=n_threads)
        else:
            backend = backend_factory(config)
        self.backend = backend
        self.drafter = ChainDrafter(backend, config.max_sequences, config.n_ctx)
        self.model_path = model_path
        self.n_threads = n_threads
        self.started = time.time()

    def info(self) -> dict:
        return {
            "pid": os.getpid(),
            "node": os.uname().nodename,
            "model": self.model_path,
            "n_vocab": self.backend.n_vocab,
            "cores": self.cores,
            "n_threads": self.n_threads,
        }

    def token_texts(self) -> list[str]:
        return self.backend.token_texts()

    def draft(self, contexts, max_tokens) -> list[list[int]]:
        return self.drafter.draft(contexts, max_tokens)

    def stats(self) -> dict:
        return self.drafter.stats.as_dict()

    def ping(self) -> bool:
        return True


def get_or_create_actor(config: DuoConfig, model_path: str, cores: list[int] | None):
    """Create the named draft actor, or attach to it if it already runs."""
    import ray

    actor_cls = ray.remote(num_cpus=0, max_concurrency=1)(DraftWorker)
    return actor_cls.options(
        name=config.actor_name,
        namespace=config.namespace,
        get_if_exists=True,
    ).remote(config.to_dict(), model_path, cores)
