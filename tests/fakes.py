"""Hand-built stand-ins for a draft backend, with known argmax."""

from __future__ import annotations

import numpy as np


class FakeBackend:
    """A 'model' whose greedy next token is ``(last * 7 + 3) % n_vocab``.

    It records every evaluated token, so tests can check what was re-evaluated,
    and keeps per-sequence token lists like a KV cache would.
    """

    def __init__(self, n_vocab: int = 50, texts: list[str] | None = None):
        self.n_vocab = n_vocab
        self.name = "fake"
        self.seqs: dict[int, list[int]] = {}
        self.evaluated: list[tuple[int, list[int], int]] = []
        self._texts = texts or [f"tok{i}" for i in range(n_vocab)]

    @staticmethod
    def next_token(last: int, n_vocab: int = 50) -> int:
        return (last * 7 + 3) % n_vocab

    def token_texts(self) -> list[str]:
        return list(self._texts)

    def truncate(self, seq_id: int, n: int) -> None:
        self.seqs[seq_id] = self.seqs.get(seq_id, [])[:n]

    def eval(self, seq_id: int, tokens, pos: int) -> np.ndarray:
        seq = self.seqs.setdefault(seq_id, [])
        assert pos == len(seq), f"eval at pos {pos} but sequence {seq_id} holds {len(seq)}"
        tokens = [int(t) for t in tokens]
        seq.extend(tokens)
        self.evaluated.append((seq_id, tokens, pos))
        logits = np.full(self.n_vocab, -10.0, dtype=np.float32)
        logits[self.next_token(tokens[-1], self.n_vocab)] = 5.0
        return logits

    def chain(self, last: int, k: int) -> list[int]:
        out = []
        for _ in range(k):
            last = self.next_token(last, self.n_vocab)
            out.append(last)
        return out
