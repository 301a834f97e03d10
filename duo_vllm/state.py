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
    # a prompt queued for this slot and not evaluated yet (the drafter's prefetch):
    # the request's first step must find this slot, not recycle another
    queued: np.ndarray | None = None


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
        """One slot per context (``None`` past the pool size), no slot twice.

        Contexts that match a slot are placed first, so a new context never
        recycles the slot of a request further down the batch.
        """
        self._clock += 1
        taken: set[int] = set()
        out: list[Assignment | None] = [None] * len(contexts)
        new = []
        for i, ctx in enumerate(contexts):
            best, match = self._best_match(ctx, taken)
            if best is None or match < self.min_reuse:
                new.append(i)
                continue
            out[i] = self._take(best, taken)
        for i in new:
            free = [s for s in self.slots if s.seq_id not in taken]
            if not free:
                break
            # no useful prefix anywhere: recycle the least recently used slot
            lru = min(free, key=lambda s: s.last_used)
            lru.queued = None  # it was queued for another request
            out[i] = self._take(Assignment(lru, common_prefix_len(lru.tokens, contexts[i])),
                                taken)
        return out

    def _best_match(self, ctx: np.ndarray, taken: set[int]) -> tuple[Assignment | None, int]:
        """The free slot with the longest common prefix (held or queued), most recent first."""
        best, best_match = None, -1
        for slot in self.slots:
            if slot.seq_id in taken:
                continue
            reuse = common_prefix_len(slot.tokens, ctx)
            match = reuse if slot.queued is None else max(
                reuse, common_prefix_len(slot.queued, ctx))
            if match > best_match or (match == best_match
                                      and slot.last_used > best.slot.last_used):
                best, best_match = Assignment(slot, reuse), match
        return best, best_match

    def _take(self, a: Assignment, taken: set[int]) -> Assignment:
        a.slot.last_used = self._clock
        taken.add(a.slot.seq_id)
        return a
