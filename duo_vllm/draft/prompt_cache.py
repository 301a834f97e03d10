"""The draft's KV kept in host memory past its slot, as llama.cpp's server prompt cache.

A slot taken for another request saves its sequence's state as an :class:`Entry`;
a context given a fresh slot restores the entry sharing its longest prefix and
evaluates only the rest: a prompt seen before is not prefilled again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from duo_vllm.draft.slots import common_prefix_len, window_match


@dataclass(frozen=True)
class Entry:
    """One evicted draft sequence: the tokens it held, its window, its saved state."""

    tokens: np.ndarray  # as the slot held them (its view of the request)
    head: int  # the slot's window (state.Slot): its first ``head`` tokens ...
    offset: int  # ... and the request's from ``offset`` on
    state: bytes | bytearray  # the backend's save() of its sequence


class PromptCache:
    """Evicted draft sequences, least recently used dropped first beyond ``max_bytes``."""

    def __init__(self, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError("PromptCache needs a positive size")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: np.ndarray, head: int, offset: int,
            state: bytes | bytearray) -> None:
        """Keep a sequence's state, dropping any entry it extends (same window)."""
        if len(state) > self.max_bytes or not len(tokens):
            return
        tokens = np.array(tokens, dtype=np.int32)
        for key, e in list(self._entries.items()):
            if e.head == head and e.offset == offset and len(e.tokens) <= len(tokens) \
                    and common_prefix_len(e.tokens, tokens) == len(e.tokens):
                self._drop(key)
        self._entries[self._next] = Entry(tokens, head, offset, state)
        self._next += 1
        self.bytes += len(state)
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def best(self, ctx: np.ndarray) -> tuple[Entry | None, int]:
        """The entry holding the longest prefix of ``ctx``, and its length; marked used."""
        best, n, key = None, 0, None
        for k, e in self._entries.items():
            m = window_match((e.tokens,), e.head, e.offset, ctx)
            if m > n:
                best, n, key = e, m, k
        if key is not None:
            self._entries.move_to_end(key)
        return best, n

    def _drop(self, key: int) -> None:
        self.bytes -= len(self._entries.pop(key).state)
