"""Sampled drafts: the draft's proposal distribution q, as pure functions.

vLLM's rejection sampler accepts a draft token x with probability
min(1, p(x) / q(x)), else samples from max(p − q, 0): the output follows the
target's p for *any* q, provided x was drawn from q (without q: one-hot at x).
So a served token with a q must be *the* draw from it: a sampled draft is served
as drawn, never picked by its content (:func:`duo_vllm.control.serving.serve`).
"""

from __future__ import annotations

import numpy as np

TOP_Q = 64  # tokens of q kept per drafted position
# The most a step's dense q may take on vLLM's device, outside its memory profile (vLLM's
# concatenation takes as much again); a step over it is verified without q (still exact).
Q_MAX_BYTES = 64 << 20


def draft_q(logits: np.ndarray, temperature: float, k: int = TOP_Q,
            limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """q at one position: the ``k`` likeliest ids (< ``limit``) of softmax(logits / T),
    renormalised."""
    logits = np.asarray(logits, dtype=np.float32)
    if limit is not None:
        logits = logits[:limit]
    k = min(k, logits.shape[-1])
    ids = np.argpartition(logits, -k)[-k:]
    z = logits[ids].astype(np.float64) / max(float(temperature), 1e-5)
    w = np.exp(z - z.max())
    order = np.argsort(-w, kind="stable")
    return ids[order].astype(np.int32), (w[order] / w.sum()).astype(np.float32)


def sample_q(ids: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from q (``ids``, ``probs``)."""
    c = np.cumsum(probs, dtype=np.float64)
    return int(ids[min(int(np.searchsorted(c, rng.random() * c[-1], side="right")),
                       len(ids) - 1)])


def q_fits(drafts: list[list[int]], vocab: int, max_bytes: int = Q_MAX_BYTES) -> bool:
    """Does :func:`dense_q` of ``drafts`` fit in ``max_bytes``?"""
    return len(drafts) * max(map(len, drafts), default=0) * vocab * 4 <= max_bytes


def dense_q(drafts: list[list[int]], qs: list, vocab: int, device="cpu"):
    """The ``[rows, width, vocab]`` tensor vLLM's rejection sampler reads: row i's q per
    token (``(ids, probs)`` each) where ``qs[i]``, else one-hots; None if no row has q."""
    if not any(q is not None for q in qs):
        return None
    rows, pos, toks, probs = [], [], [], []
    for i, (draft, q) in enumerate(zip(drafts, qs)):
        for j, tok in enumerate(draft):
            ids, p = q[j] if q is not None else ((tok,), (1.0,))
            rows.append(np.full(len(ids), i))
            pos.append(np.full(len(ids), j))
            toks.append(np.asarray(ids))
            probs.append(np.asarray(p, dtype=np.float32))
    if not rows:
        return None
    import torch

    out = torch.zeros((len(drafts), max(len(d) for d in drafts), vocab),
                      dtype=torch.float32, device=device)
    r, j, t, p = (torch.from_numpy(np.concatenate(x)).to(device)
                  for x in (rows, pos, toks, probs))
    out[r.long(), j.long(), t.long()] = p
    return out
