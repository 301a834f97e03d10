"""Which cached draft sequence serves which request: longest-common-prefix matching
(vLLM passes a proposer no request ids; the drafter evaluates only the rest).

A slot may hold a *window* of its request: its first ``head`` tokens (chat
template, system prompt) and its last ``window - head`` from ``offset`` on, so a
long prompt is prefilled sooner. Every array a slot holds, and every match
against it, is in window coordinates (:meth:`Slot.view`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from duo_vllm.control.drafting import saves_work


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
    # a prompt queued by prefetch, not evaluated yet: its request's first step finds this slot
    queued: np.ndarray | None = None
    queued_at: int = 0
    # the context of the request it served last: its name even while nothing is evaluated
    seen: np.ndarray | None = None
    offset: int = 0  # the request's context from here on is the slot's (its window)
    head: int = 0  # ... after its first ``head`` tokens

    def view(self, ctx: np.ndarray) -> np.ndarray:
        """``ctx`` as this slot holds it: its head, then from its offset on."""
        return window_view(ctx, self.head, self.offset)


@dataclass(frozen=True)
class Assignment:
    """A slot chosen for a context, and how much of the slot is reusable."""

    slot: Slot
    reuse: int  # tokens of slot.tokens that equal the view's prefix
    view: np.ndarray  # the context as the slot holds it (from slot.offset on)
    # a slot taken afresh: the window (head, offset) of the tokens it still holds
    before: tuple[int, int] | None = None


def window_view(ctx: np.ndarray, head: int, offset: int) -> np.ndarray:
    """``ctx`` as a window holds it: its first ``head`` tokens, then from ``offset`` on."""
    if offset == 0:
        return ctx
    return np.concatenate([ctx[:head], ctx[offset:]])


def window_match(held, head: int, offset: int, ctx: np.ndarray) -> int:
    """The longest prefix of ``ctx``'s view in a window that one of ``held`` (``None``s
    skipped) has; in a window, only a match beyond its head (every request's) counts."""
    if len(ctx) <= offset:  # shorter than the window's start: another request
        return 0
    view = window_view(ctx, head, offset)
    m = max((common_prefix_len(h, view) for h in held if h is not None), default=0)
    return m if m > head or not offset else 0  # a shared head is no match


def pool_window(window: int | None, n_ctx: int) -> int | None:
    """The tokens of a request the draft sees: ``window`` (``None`` or 0: all), at most
    half the draft's context, so a full window slides on by the other half."""
    return min(window, n_ctx // 2) if window else None


class SlotPool:
    """At most ``size`` draft sequences; ``assign`` gives each context of a batch one:

    1. the slot it shares the longest prefix beyond the chat template with,
       longest matches first, where that leaves less to evaluate than a fresh slot;
    2. else an empty slot, else the least recently used one, never a ``live``
       slot nor one queued for a prompt, holding the context's window;
    3. else none: the request decodes without a draft.
    """

    QUEUED_TTL = 256  # assign() calls a queued prompt keeps its slot without showing up

    def __init__(self, size: int, window: int | None = None):
        if size < 1:
            raise ValueError("SlotPool needs at least one slot")
        self.size, self.window = size, window
        self.slots = [Slot(seq_id=i) for i in range(size)]
        self.template_len = 0  # the prefix all prompts share (learned by note_prompts)
        self._last_prompt: np.ndarray | None = None
        self.clock = 0

    def note_prompts(self, prompts: list[np.ndarray]) -> None:
        """Learn the chat template's length: the shortest prefix distinct prompts share."""
        for p in prompts:
            last = self._last_prompt
            if last is not None and not np.array_equal(last, p):
                shared = common_prefix_len(last, p)
                if self.template_len == 0 or shared < self.template_len:
                    self.template_len = shared
            self._last_prompt = p

    def _match(self, slot: Slot, ctx: np.ndarray) -> int:
        return window_match((slot.tokens, slot.queued, slot.seen), slot.head, slot.offset, ctx)

    def _protected(self, slot: Slot) -> bool:
        if slot.queued is None:
            return False
        if self.clock - slot.queued_at > self.QUEUED_TTL:
            slot.queued = None  # its request never came (aborted)
            return False
        return True

    def assign(self, contexts: list[np.ndarray],
               live: set[int] | frozenset[int] = frozenset()) -> list[Assignment | None]:
        """One slot per context (``None`` when none is free), no slot twice."""
        self.clock += 1
        need = self.template_len + 1
        pairs = []
        for i, ctx in enumerate(contexts):
            fresh = self.fresh_tokens(len(ctx))
            for slot in self.slots:
                m = self._match(slot, ctx)
                # (else a long prompt would get the whole view of a short one it extends)
                if m >= need and saves_work(len(slot.view(ctx)), m, fresh):
                    pairs.append((m, slot.last_used, -i, slot.seq_id))
        taken: set[int] = set()
        out: list[Assignment | None] = [None] * len(contexts)
        for _, _, neg_i, seq_id in sorted(pairs, reverse=True):
            if out[-neg_i] is None and seq_id not in taken:
                out[-neg_i] = self._take(self.slots[seq_id], contexts[-neg_i], taken)
        for i, ctx in enumerate(contexts):
            if out[i] is not None:
                continue
            free = [s for s in self.slots if s.seq_id not in taken and s.seq_id not in live
                    and not self._protected(s)]
            if not free:
                continue
            # no real prefix anywhere: an empty slot, else the least recently used one
            slot = min(free, key=lambda s: (len(s.tokens) > 0, s.last_used, s.seq_id))
            slot.queued = slot.seen = None  # names of another request
            before = slot.head, slot.offset
            self.place(slot, len(ctx))
            out[i] = dataclasses.replace(self._take(slot, ctx, taken), before=before)
        return out

    def fresh_tokens(self, length: int) -> int:
        """Tokens a slot taken afresh for a ``length``-token context evaluates."""
        return length if self.window is None else min(length, self.window)

    def place(self, slot: Slot, length: int) -> None:
        """Set the window of a slot taken for a ``length``-token context."""
        if self.window is None or length <= self.window:
            slot.head, slot.offset = 0, 0
        else:
            slot.head = self.window // 4
            slot.offset = length - (self.window - slot.head)

    def _take(self, slot: Slot, ctx: np.ndarray, taken: set[int]) -> Assignment:
        slot.last_used = self.clock
        taken.add(slot.seq_id)
        view = slot.view(ctx)
        return Assignment(slot, common_prefix_len(slot.tokens, view), view)
