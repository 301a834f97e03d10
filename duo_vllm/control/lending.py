"""When lending the draft's cores to a CPU target pays (the lending itself:
:mod:`duo_vllm.host.lending`)."""

from __future__ import annotations


def remake_pays(prefill_tokens: int, per_token_s: float, drafting: int, full: int,
                remake_s: float) -> bool:
    """Remake the target's matmuls before a lent step that would reuse one made on fewer
    threads (:class:`~duo_vllm.host.lending.MatmulPrimitives`)? Always before a decode step
    (its row count recurs); before a prefill of ``n`` tokens (its row count runs once) where
    the time it saves, ``n·per_token_s·(1 - drafting/full)``, exceeds ``remake_s``."""
    if prefill_tokens <= 0:
        return True
    return prefill_tokens * per_token_s * (1 - drafting / full) > remake_s
