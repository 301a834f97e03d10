"""Hand-built stand-ins for a draft backend, with known distributions."""

from __future__ import annotations

import time

import numpy as np

from duo_vllm.control.serving import Hint
from duo_vllm.control.verdict import LOOKUP
from duo_vllm.sources.base import Proposal


def hint_of(tokens, alpha_model: float, alpha_lookup, threshold: float) -> Hint:
    """A drafter hint of one lookup draft."""
    return Hint((Proposal(LOOKUP, list(tokens), alpha_lookup),), alpha_model, threshold)


def wait_idle(worker, timeout: float = 10.0) -> bool:
    """Block until a DraftWorker's pending pre-draft has run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with worker._lock:
            if worker._idle() and not worker._wake.is_set():
                return True
        time.sleep(0.002)
    return False


class FakeBackend:
    """A multi-sequence 'model' with a hand-set next-token distribution.

    By default the greedy next token is ``(last * 7 + 3) % n_vocab`` with
    probability ~0.9. ``spread`` maps a last token to a dict
    ``{token: logit}`` to make the draft unsure there. Sequences behave like
    llama.cpp's: positions must be consecutive, ``copy`` shares a prefix.
    Every evaluated token is recorded.
    """

    def __init__(self, n_vocab: int = 50, texts: list[str] | None = None,
                 spread: dict[int, dict[int, float]] | None = None):
        self.n_vocab = n_vocab
        self.name = "fake"
        self.seqs: dict[int, list[int]] = {}
        self.evaluated: list[tuple[int, list[int], int]] = []
        self.decode_calls = 0
        self.spread = spread or {}
        self._texts = texts or [f"tok{i}" for i in range(n_vocab)]

    @staticmethod
    def next_token(last: int, n_vocab: int = 50) -> int:
        return (last * 7 + 3) % n_vocab

    def logits_after(self, last: int) -> np.ndarray:
        logits = np.zeros(self.n_vocab, dtype=np.float32)
        if last in self.spread:
            for tok, value in self.spread[last].items():
                logits[tok] = value
        else:
            logits[self.next_token(last, self.n_vocab)] = 8.0
        return logits

    def token_texts(self) -> list[str]:
        return list(self._texts)

    def remove(self, seq_id: int, p0: int, p1: int = -1) -> None:
        seq = self.seqs.get(seq_id, [])
        end = len(seq) if p1 < 0 else p1
        self.seqs[seq_id] = seq[:p0] + seq[end:]

    def copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        s = self.seqs.get(src, [])
        end = len(s) if p1 < 0 else p1
        d = self.seqs.get(dst, [])
        assert len(d) == p0, "copy must append to a sequence that ends at p0"
        self.seqs[dst] = d + s[p0:end]

    def save(self, seq_id: int) -> bytes:
        return np.asarray(self.seqs.get(seq_id, []), dtype=np.int64).tobytes()

    def restore(self, seq_id: int, state: bytes) -> bool:
        assert not self.seqs.get(seq_id), "restore into a sequence that is not empty"
        self.seqs[seq_id] = np.frombuffer(state, dtype=np.int64).tolist()
        return True

    def decode(self, items):
        self.decode_calls += 1
        out = []
        for seq_id, tokens, pos in items:
            seq = self.seqs.setdefault(seq_id, [])
            assert pos == len(seq), f"eval at pos {pos} but sequence {seq_id} holds {len(seq)}"
            tokens = [int(t) for t in tokens]
            seq.extend(tokens)
            self.evaluated.append((seq_id, tokens, pos))
            out.append(self.logits_after(tokens[-1]))
        return out

    def chain(self, last: int, k: int) -> list[int]:
        out = []
        for _ in range(k):
            last = self.next_token(last, self.n_vocab)
            out.append(last)
        return out
