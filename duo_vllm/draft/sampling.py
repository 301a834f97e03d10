"""Sampled drafts: the draft's proposal distribution q, as pure functions.

For a sampled request (temperature T > 0), vLLM's rejection sampler accepts
a draft token x with probability min(1, p(x) / q(x)) and otherwise samples
from max(p − q, 0), renormalised. The output then follows the target's p
exactly, for *any* q, provided x was drawn from q. Without q, vLLM takes the
draft as certain (q one-hot at x): any x is then lossless, and x is accepted
with probability p(x) alone. So:

* a draft that is the argmax (today's greedy drafting) is accepted at about
  E[p(argmax)], 0.57 per token here at T = 0.7;
* a draft sampled from q = softmax(draft logits / T) is accepted at
  Σ min(p, q), near 1 when draft and target agree (one model at two
  precisions, say).

:func:`draft_q` is q, cut to the draft's ``TOP_Q`` most likely tokens and
renormalised (a valid proposal: only q must be known exactly), so a drafted
token carries 2·``TOP_Q`` numbers, not the vocabulary. :func:`sample_q`
draws from it. :func:`dense_q` lays a step's q out as the
``[rows, width, vocab]`` tensor vLLM's rejection sampler reads, one-hot for
tokens drafted without q (lookup copies, greedy drafts): exact either way.

Lossless needs every served token with a q to be *the* draw from that q: a
sampled draft is served as drawn (a prefix of it, cut at a length fixed
before drawing), never picked among alternatives by its content. See
:func:`duo_vllm.control.serving.serve`.
"""

from __future__ import annotations

import numpy as np

TOP_Q = 64  # tokens of q kept per drafted position
# The most a step's dense q may take (float32, [rows, width, vocab]) on vLLM's device,
# outside its memory profile; vLLM's own concatenation of its rows takes as much again.
# A step over it is verified without q: each draft taken as certain, exact for any draft.
Q_MAX_BYTES = 64 << 20


def draft_q(logits: np.ndarray, temperature: float, k: int = TOP_Q,
            limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """q at one position: the ``k`` most likely token ids (below ``limit``) of
    softmax(logits / temperature), and their probabilities renormalised to sum to 1."""
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


def q_entries(drafts: list[list[int]], qs: list):
    """Every nonzero of a step's draft distributions, as (row, position, token, prob)
    arrays. ``drafts[i]`` is row i's draft, ``qs[i]`` its q per token (``(ids,
    probs)`` pairs) or None. A row with q gets it; any other drafted token gets
    a one-hot at itself (vLLM's reading of a draft without q). None when no row
    has q: vLLM then needs no probabilities at all."""
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
    return tuple(np.concatenate(x) for x in (rows, pos, toks, probs))


def q_fits(drafts: list[list[int]], vocab: int, max_bytes: int = Q_MAX_BYTES) -> bool:
    """Does :func:`dense_q` of ``drafts`` fit in ``max_bytes``?"""
    return len(drafts) * max(map(len, drafts), default=0) * vocab * 4 <= max_bytes


def dense_q(drafts: list[list[int]], qs: list, vocab: int, device="cpu"):
    """The ``[rows, width, vocab]`` float32 tensor vLLM's rejection sampler reads,
    built on ``device`` from :func:`q_entries` (None where that is None)."""
    entries = q_entries(drafts, qs)
    if entries is None:
        return None
    import torch

    out = torch.zeros((len(drafts), max(len(d) for d in drafts), vocab),
                      dtype=torch.float32, device=device)
    r, j, t, p = (torch.from_numpy(x).to(device) for x in entries)
    out[r.long(), j.long(), t.long()] = p
    return out
