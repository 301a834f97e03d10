"""Each step's contexts as deltas against those the draft actor holds, not O(context) a row.

A row is the receiver's ``context[:start]`` plus new tokens, ``check`` (its
``context[start - 1]``) a guard. A mismatch (a new actor, a call never sent) costs drafts,
never a wrong context: the row's key is named in :attr:`Drafts.resend`, to be sent in full
next step. Keys absent from a step are forgotten on both sides: memory is bounded by the batch.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np


class Delta(NamedTuple):
    keys: list
    starts: list  # tokens of the key's held context that the row keeps (0: sent in full)
    checks: list  # context[start - 1] (-1 where start is 0)
    lengths: list  # each row's new tokens
    tokens: bytes  # every row's new tokens, concatenated, int32 (bytes pickle 3x faster)


class Drafts(list):
    """A step's drafts (one per row) with ``resend`` (the keys the receiver lacked),
    ``q`` (each sampled row's draft probabilities, :mod:`duo_vllm.draft.sampling`) and
    ``idle`` (the draft side leaves its cores free during the step). Without any of
    these a step returns a plain list, which pickles faster."""

    def __init__(self, drafts=(), resend=(), q=None, idle: bool = False):
        super().__init__(drafts)
        self.resend = list(resend)
        self.q = q
        self.idle = idle


def _extends(ctx: np.ndarray, prev: np.ndarray) -> bool:
    n = len(prev)
    return 0 < n <= len(ctx) and ctx[n - 1] == prev[-1] and np.array_equal(ctx[:n], prev)


class DeltaSender:
    """The proposer's side. It keeps the arrays it encodes: callers must not change them."""

    def __init__(self):
        self._sent: dict = {}  # key -> the context the receiver holds

    def reset(self) -> None:
        """Send every row in full next time (a new actor, a call that may not have run)."""
        self._sent = {}

    def forget(self, keys) -> None:
        for key in keys:
            self._sent.pop(key, None)

    def encode(self, keys: list, contexts: list) -> Delta:
        counts = Counter(keys)
        sent, held = self._sent, {}
        starts, checks, parts = [], [], []
        for key, ctx in zip(keys, contexts):
            ctx = np.asarray(ctx, dtype=np.int32)
            prev = sent.get(key) if counts[key] == 1 else None  # a repeated key: in full
            start = len(prev) if prev is not None and _extends(ctx, prev) else 0
            starts.append(start)
            checks.append(int(ctx[start - 1]) if start else -1)
            parts.append(ctx[start:])
            held[key] = ctx
        self._sent = held  # keys absent from this step are forgotten
        lengths = [len(p) for p in parts]
        tokens = np.concatenate(parts).tobytes() if parts else b""
        return Delta(list(keys), starts, checks, lengths, tokens)


class _Held:
    """A key's context, grown in place; each position is written once, so views handed
    out earlier never change."""

    __slots__ = ("buf", "n")

    def __init__(self, tokens: np.ndarray):
        self.buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int32)
        self.buf[:len(tokens)] = tokens
        self.n = len(tokens)

    def append(self, tokens: np.ndarray) -> None:
        end = self.n + len(tokens)
        if end > len(self.buf):
            buf = np.empty(2 * end, dtype=np.int32)
            buf[:self.n] = self.buf[:self.n]
            self.buf = buf
        self.buf[self.n:end] = tokens
        self.n = end

    def view(self) -> np.ndarray:
        out = self.buf[:self.n]
        out.flags.writeable = False
        return out


class DeltaReceiver:
    """The actor's side: key -> the context last decoded for it."""

    def __init__(self):
        self._held: dict = {}

    def decode(self, delta: Delta) -> tuple[list, list]:
        """(each row's full context or None where this side lacks its prefix, the keys
        of the None rows). Never raises."""
        keys = list(delta.keys)
        try:
            return self._decode(keys, delta)
        except Exception:  # a malformed delta: every row in full next step
            self._held = {}
            return [None] * len(keys), keys

    def _decode(self, keys, delta: Delta):
        old, held = self._held, {}
        self._held = {}  # until decoded: a failure below leaves nothing half-written
        tokens = delta.tokens
        if isinstance(tokens, (bytes, bytearray, memoryview)):
            tokens = np.frombuffer(tokens, dtype=np.int32)
        tokens = np.asarray(tokens, dtype=np.int32)
        if not (len(keys) == len(delta.starts) == len(delta.checks) == len(delta.lengths)
                and sum(delta.lengths) == len(tokens)):
            raise ValueError("inconsistent delta")
        out, resend, pos = [], [], 0
        for key, start, check, length in zip(keys, delta.starts, delta.checks, delta.lengths):
            new, pos = tokens[pos:pos + length], pos + length
            h = old.pop(key, None)  # pop: a repeated key cannot extend one buffer twice
            if start == 0:
                h = _Held(new)
            elif h is not None and h.n == start and int(h.buf[start - 1]) == check:
                h.append(new)
            else:  # not what the sender thinks this side holds
                out.append(None)
                resend.append(key)
                continue
            held[key] = h
            out.append(h.view())
        self._held = held  # keys absent from this step are forgotten
        return out, resend

    def __len__(self) -> int:
        return len(self._held)
