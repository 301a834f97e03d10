"""DuoDecoding's branch and budget maths, as pure functions.

:func:`branch_candidates` is the dynamic multi-sequence rule: with p1 the draft's
distribution where the target samples next and p2 one step further along its
top-1, every other top candidate of p1 above θ = p1[top1] · p2[top2] starts a branch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from duo_vllm.draft.slots import common_prefix_len

TOP_K = 8


def top_candidates(logits: np.ndarray, k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` token ids and their softmax probabilities, most likely first."""
    logits = np.asarray(logits)
    k = min(k, logits.shape[-1])
    idx = np.argpartition(logits, -k)[-k:]
    top = logits[idx].astype(np.float64)
    m = float(logits.max())
    # float32 exp over the vocabulary, summed in float64: no float64 copy of logits
    denom = float(np.exp(logits - np.float32(m)).sum(dtype=np.float64))
    probs = np.exp(top - m) / denom
    order = np.argsort(-probs, kind="stable")
    return idx[order].astype(np.int64), probs[order]


def branch_candidates(top_ids: np.ndarray, top_probs: np.ndarray, p2_top: float,
                      max_branches: int) -> list[int]:
    """First tokens of the branches to draft: top-1 always, others above θ."""
    if len(top_ids) == 0:
        return []
    theta = float(top_probs[0]) * float(p2_top)
    chosen = [int(top_ids[0])]
    for tok, p in zip(top_ids[1:], top_probs[1:]):
        if len(chosen) >= max_branches:
            break
        if float(p) > theta:
            chosen.append(int(tok))
    return chosen


def split_budget(total: int, weights: list[float], cap: int, alpha: float = 0.8) -> list[int]:
    """Share ``total`` draft evaluations among branches, at most ``cap`` each, each where
    it adds the most expected accepted tokens (ties: the earlier branch)."""
    n = len(weights)
    alloc = [0] * n
    for _ in range(max(0, min(total, cap * n))):
        gains = [(weights[j] * alpha ** alloc[j] if alloc[j] < cap else -1.0, -j)
                 for j in range(n)]
        _, neg_j = max(gains)
        alloc[-neg_j] += 1
    return alloc


@dataclass
class Branch:
    """A pre-drafted continuation of its tree's prefix (``tokens[0]``: the target's next)."""

    tokens: list[int]
    seq_id: int
    q: list = field(default_factory=list)  # each of tokens[1:]'s q (None: the argmax)

    def drawn(self, n: int, start: int = 0) -> list | None:
        """The q of ``n`` draft tokens from ``tokens[1 + start]`` on, if each was drawn."""
        q = self.q[start:start + n]
        return q if n and len(q) == n and all(x is not None for x in q) else None


@dataclass
class Tree:
    """The pre-draft for one request: branches that continue ``prefix``."""

    prefix: np.ndarray  # the context assuming the last draft is fully accepted
    branches: list[Branch] = field(default_factory=list)


def miss_reason(tree: Tree | None, context: np.ndarray) -> str:
    """Why :func:`select_branch` finds no branch for ``context``: ``"no_tree"`` (nothing
    was pre-drafted), ``"rejected"`` (the target did not accept the whole draft the
    tree continues) or ``"bonus"`` (it did, but its next token starts no branch)."""
    if tree is None:
        return "no_tree"
    whole = len(context) == len(tree.prefix) + 1 and np.array_equal(context[:-1], tree.prefix)
    return "bonus" if whole else "rejected"


def select_branch(tree: Tree | None, context: np.ndarray) -> Branch | None:
    """The branch that continues ``context``: the tree's prefix, then the branch's first
    token, or several of its tokens with one left to serve."""
    if tree is None:
        return None
    root = len(tree.prefix)
    follow = len(context) - root
    if follow < 1 or common_prefix_len(context, tree.prefix) < root:
        return None
    tail = [int(t) for t in context[root:]]
    for br in tree.branches:
        if br.tokens[:follow] == tail and (follow == 1 or len(br.tokens) > follow):
            return br
    return None
