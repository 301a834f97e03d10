"""The draft's KV kept in host memory past its slot: a prompt seen before is not
prefilled again.

vLLM's prefix cache spares the *target* a repeated prompt (a retried request, a
shared system prompt, the next turn of a chat, the same document asked about
again), but the draft's slots are few (``max_sequences``) and taken by least
recent use: a request whose slot went to others meanwhile had its prompt
prefilled by the draft anew, beside the target's decode, before the draft
could draft for it. llama.cpp's server keeps evicted prompts in host memory
for the same reason (its prompt cache).

Here a slot about to be taken for another request leaves its sequence's state
(the backend's ``save``) as an :class:`Entry`, keyed by the tokens it held,
in window coordinates (:mod:`duo_vllm.draft.slots`); a context given a fresh slot
takes the entry it shares the longest prefix with (:meth:`PromptCache.best`),
restored into that slot (``restore``), and evaluates only the rest. Entries
are dropped least recently used first beyond ``max_bytes``. The restored
cells are the draft's own, computed from the same tokens: drafts change
speed, never output.
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

    def match(self, ctx: np.ndarray) -> int:
        """Tokens of ``ctx``, as this entry's window holds it, that the entry holds
        (:func:`~duo_vllm.draft.slots.window_match`, as for a slot)."""
        return window_match((self.tokens,), self.head, self.offset, ctx)


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
        """Keep a sequence's state; an entry it extends (same window, a prefix of its
        tokens) goes, being of no more use."""
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
        """The entry holding the longest prefix of ``ctx`` (its view of it), and how
        many tokens; it counts as used (dropped last)."""
        best, n, key = None, 0, None
        for k, e in self._entries.items():
            m = e.match(ctx)
            if m > n:
                best, n, key = e, m, k
        if key is not None:
            self._entries.move_to_end(key)
        return best, n

    def _drop(self, key: int) -> None:
        self.bytes -= len(self._entries.pop(key).state)
