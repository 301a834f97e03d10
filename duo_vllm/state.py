"""Which cached draft sequence serves which request: longest-common-prefix matching.

The draft side owns its state, as llama.cpp's ``common/speculative`` does.
The caller only ever hands over the full token context of a request; the
drafter finds the cached sequence that shares the longest prefix with it,
keeps that prefix (its KV cache is still valid) and evaluates the rest. The
caller never tells it what was accepted or rolled back. vLLM does not pass
request ids to a custom proposer, so this matching is also what tells
requests apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D integer arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


@dataclass
class Slot:
    """One cached draft sequence: its id in the backend and the tokens it holds."""

    seq_id: int
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    last_used: int = 0


@dataclass(frozen=True)
class Assignment:
    """A slot chosen for a context, and how much of the slot is reusable."""

    slot: Slot
    reuse: int  # tokens of slot.tokens that equal the context's prefix


class SlotPool:
    """A bounded pool of draft sequences, matched to contexts by common prefix.

    ``assign`` picks, for each context of a batch, a distinct slot: the one
    with the longest common prefix, or else the least recently used one.
    Memory stays bounded: there are never more than ``size`` slots.
    """

    def __init__(self, size: int, min_reuse: int = 1):
        if size < 1:
            raise ValueError("SlotPool needs at least one slot")
        self.size = size
        self.slots = [Slot(seq_id=i) for i in range(size)]
        self.min_reuse = min_reuse
        self._clock = 0

    def assign(self, contexts: list[np.ndarray]) -> list[Assignment | None]:
        """One slot per context (``None`` past the pool size), no slot twice."""
        self._clock += 1
        taken: set[int] = set()
        out: list[Assignment | None] = []
        for ctx in contexts:
            best: Assignment | None = None
            for slot in self.slots:
                if slot.seq_id in taken:
                    continue
                reuse = common_prefix_len(slot.tokens, ctx)
                if best is None or reuse > best.reuse or (
                    reuse == best.reuse and slot.last_used > best.slot.last_used
                ):
                    best = Assignment(slot, reuse)
            if best is None:
                out.append(None)
                continue
            if best.reuse < self.min_reuse:
                # No useful prefix anywhere: recycle the least recently used slot.
                free = [s for s in self.slots if s.seq_id not in taken]
                lru = min(free, key=lambda s: s.last_used)
                best = Assignment(lru, common_prefix_len(lru.tokens, ctx))
            best.slot.last_used = self._clock
            taken.add(best.slot.seq_id)
            out.append(best)
        return out
