"""DuoDecoding's branch and budget maths, as pure functions.

* :func:`top_candidates` / :func:`branch_candidates`: the dynamic
  multi-sequence rule. With p1 the draft's distribution at the position the
  target will sample next and p2 its distribution one step further along the
  top-1 choice, let θ = p1[top1] · p2[top2]. Every other top candidate of p1
  whose probability exceeds θ starts its own branch.
* :func:`split_budget`: share a token budget among branches.
* how many tokens to draft at all is the goodput controller's
  (:mod:`duo_vllm.control.goodput`).
* :func:`select_branch`: given the context the target produced, which
  pre-drafted branch (if any) continues it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from duo_vllm.draft.slots import common_prefix_len

TOP_K = 8


def top_candidates(logits: np.ndarray, k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` token ids and their softmax probabilities, most likely first.

    Only ``k`` values leave this function: the full distribution is never copied.
    """
    logits = np.asarray(logits)
    k = min(k, logits.shape[-1])
    idx = np.argpartition(logits, -k)[-k:]
    top = logits[idx].astype(np.float64)
    m = float(logits.max())
    denom = _sum_exp(logits, m)
    probs = np.exp(top - m) / denom
    order = np.argsort(-probs, kind="stable")
    return idx[order].astype(np.int64), probs[order]


def _sum_exp(logits: np.ndarray, m: float) -> float:
    # float32 exp over the vocabulary, summed in float64: no float64 copy of logits
    return float(np.exp(logits - np.float32(m)).sum(dtype=np.float64))


def branch_candidates(top_ids: np.ndarray, top_probs: np.ndarray, p2_top: float,
                      max_branches: int) -> list[int]:
    """First tokens of the branches to draft: top-1 always, others above θ.

    ``top_probs`` are sorted descending; ``p2_top`` is the top probability one
    position later, along the top-1 choice. θ = top_probs[0] · p2_top.
    """
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
    """Share ``total`` draft evaluations among branches, by expected accepted tokens.

    Branch j is taken with probability ``weights[j]``; its i-th token is then
    accepted with probability about ``alpha ** i``. Each evaluation goes to
    the branch where it adds the most expected accepted tokens,
    ``weights[j] * alpha ** alloc[j]`` (ties: the earlier branch), and no
    branch gets more than ``cap``. A confident draft thus puts everything in
    its top-1 chain; an unsure one spreads over the branches the θ rule opened.
    """
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
    """A pre-drafted continuation of its tree's prefix: ``tokens[0]`` is the candidate
    for the target's next token."""

    tokens: list[int]
    prob: float
    seq_id: int
    # each draft token's q (duo_vllm/draft/sampling.py), aligned with tokens[1:]; None where
    # it was the argmax (greedy)
    q: list = field(default_factory=list)

    def drawn(self, n: int, start: int = 0) -> list | None:
        """The q of ``n`` draft tokens from ``tokens[1 + start]`` on, if each was drawn."""
        q = self.q[start:start + n]
        return q if n and len(q) == n and all(x is not None for x in q) else None


@dataclass
class Tree:
    """The pre-draft for one request: branches that continue ``prefix``."""

    prefix: np.ndarray  # the context assuming the last draft is fully accepted
    branches: list[Branch] = field(default_factory=list)


def accepted_whole(tree: Tree, context: np.ndarray) -> bool:
    """Is ``context`` ``tree.prefix`` plus exactly one token (the target accepted the
    whole draft the tree continues and sampled one more)?"""
    return len(context) == len(tree.prefix) + 1 and np.array_equal(context[:-1], tree.prefix)


def miss_reason(tree: Tree | None, context: np.ndarray) -> str:
    """Why :func:`select_branch` finds no branch for ``context``: ``"no_tree"`` (nothing
    was pre-drafted), ``"rejected"`` (the target did not accept the whole draft the
    tree continues) or ``"bonus"`` (it did, but its next token starts no branch)."""
    if tree is None:
        return "no_tree"
    return "bonus" if accepted_whole(tree, context) else "rejected"


def select_branch(tree: Tree | None, context: np.ndarray) -> Branch | None:
    """The branch that continues ``context``, if the pre-draft foresaw it.

    It does when ``context`` is the tree's prefix followed by the start of the
    branch: its first token (the target accepted the whole draft the tree
    continues and sampled one more, :func:`accepted_whole`), or several of its
    tokens with one left to serve (a tree rooted inside the draft served: the
    served tokens the target accepted and its own next one follow the branch).
    """
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
