"""Greedy chain drafting on top of a backend, with per-request state by common prefix."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from .state import SlotPool

logger = logging.getLogger(__name__)


@dataclass
class DraftStats:
    """Counters of the draft side, cumulative since start."""

    calls: int = 0
    requests: int = 0
    drafted_tokens: int = 0
    prefill_tokens: int = 0  # context tokens evaluated to catch up
    reused_tokens: int = 0  # context tokens whose KV cache was reused
    draft_seconds: float = 0.0
    errors: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class ChainDrafter:
    """Drafts one greedy chain per context, re-evaluating only new tokens.

    For each context it keeps the longest prefix already in the backend's
    KV cache for the matched slot, evaluates the rest, then extends greedily.
    Drafted tokens stay in the cache: when the target accepts them they are
    part of the next context's common prefix and are not evaluated again.
    """

    def __init__(self, backend, max_sequences: int, n_ctx: int):
        self.backend = backend
        self.n_ctx = n_ctx
        self.pool = SlotPool(max_sequences)
        self.stats = DraftStats()

    def draft(self, contexts: list[np.ndarray], max_tokens: list[int]) -> list[list[int]]:
        t0 = time.perf_counter()
        self.stats.calls += 1
        contexts = [np.asarray(c, dtype=np.int32) for c in contexts]
        out: list[list[int]] = []
        for ctx, k, a in zip(contexts, max_tokens, self.pool.assign(contexts)):
            k = min(int(k), self.n_ctx - len(ctx))
            if a is None or k <= 0 or len(ctx) == 0:
                out.append([])
                continue
            self.stats.requests += 1
            try:
                out.append(self._draft_one(a.slot, a.reuse, ctx, k))
            except Exception:
                logger.exception("draft failed for a request; it gets no draft this step")
                self.stats.errors += 1
                a.slot.tokens = np.zeros(0, dtype=np.int32)
                self.backend.truncate(a.slot.seq_id, 0)
                out.append([])
        self.stats.draft_seconds += time.perf_counter() - t0
        return out

    def _draft_one(self, slot, reuse: int, ctx: np.ndarray, k: int) -> list[int]:
        # Logits are only available for tokens evaluated in this call, so at
        # least the last context token is always (re-)evaluated.
        keep = min(reuse, len(ctx) - 1)
        self.backend.truncate(slot.seq_id, keep)
        slot.tokens = slot.tokens[:keep]
        logits = self.backend.eval(slot.seq_id, ctx[keep:], keep)
        self.stats.prefill_tokens += len(ctx) - keep
        self.stats.reused_tokens += keep
        slot.tokens = ctx
        draft: list[int] = []
        pos = len(ctx)
        while True:
            token = int(np.argmax(logits))
            draft.append(token)
            if len(draft) == k:
                break
            logits = self.backend.eval(slot.seq_id, np.array([token], dtype=np.int32), pos)
            pos += 1
        slot.tokens = np.concatenate([ctx, np.array(draft[:-1], dtype=np.int32)])
        self.stats.drafted_tokens += len(draft)
        return draft
