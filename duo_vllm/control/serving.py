"""What a row is served among its sources' proposals (:func:`serve`), each token only while
its chance of acceptance pays for its verification: a free source's tail is cut to the
tokens whose acceptance beats c · goodput; the model's draft, planned by the controller,
never. The drafter computes the same from a :class:`Hint` and pre-drafts from its end."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from numbers import Real

from duo_vllm.control.goodput import token_alphas
from duo_vllm.control.verdict import MODEL
from duo_vllm.sources.base import Proposal, common_prefix


@dataclass(frozen=True)
class Hint:
    """A row's free proposals and what :func:`serve` weighs them by, for the drafter."""

    proposals: tuple  # the free sources' Proposals, in registration order
    alpha_model: float
    threshold: float


def alpha_of(hint: Hint, source: str):
    """The α of ``source``'s proposal in ``hint``."""
    return next(p.alpha for p in hint.proposals if p.source == source)


def paying_length(lead: float, alpha: float | Sequence[float], n: int, threshold: float,
                  start: int = 0) -> int:
    """Tokens of an ``n``-token tail of a free source worth verifying: its t-th token is
    accepted with probability ``lead`` · α₁ ··· αₜ (``lead``: that of the tokens before
    the tail; α from token ``start`` on) and pays while that beats ``threshold``."""
    t, p = 0, lead
    for a in token_alphas(alpha, n, start):
        if p * a <= threshold:
            break
        t, p = t + 1, p * a
    return t


def _prefers(a: Proposal, b: Proposal) -> bool:
    """Is ``b`` the better of the two, uncut? Where one is a prefix of the other the
    longer; where they part, the one whose token there is more likely accepted."""
    if not b.tokens:
        return False
    if not a.tokens:
        return True
    agree = common_prefix(a.tokens, b.tokens)
    if agree == len(a.tokens) or agree == len(b.tokens):
        return len(b.tokens) > len(a.tokens)
    return token_alphas(b.alpha, 1, agree)[0] > token_alphas(a.alpha, 1, agree)[0]


def pick(a: Proposal, b: Proposal, threshold: float) -> Proposal:
    """The draft served from ``a`` (the choice so far, served uncut) and a free
    source's ``b``, whose tail is cut to what pays for its verification."""
    if not _prefers(a, b):
        return a
    agree = common_prefix(a.tokens, b.tokens)
    if agree == len(a.tokens):  # a's draft, extended by b's tail
        lead = a.alpha ** agree if isinstance(a.alpha, Real) else \
            math.prod(token_alphas(a.alpha, agree))
        n = agree + paying_length(lead, b.alpha, len(b.tokens) - agree, threshold, start=agree)
        if a.tokens and n <= len(a.tokens):
            return a
        return replace(b, tokens=b.tokens[:n])
    n = paying_length(1.0, b.alpha, len(b.tokens), threshold)  # they part: b's own
    return replace(b, tokens=b.tokens[:n]) if n else a


def serve(model: list[int], drawn: bool, hint: Hint | None) -> tuple[list[int], str]:
    """What a row is served: its model draft and its free proposals folded by :func:`pick`,
    in order; (tokens, source). A non-empty model draft ``drawn`` from the draft's q (a
    sampled request) is served as it is: the rejection sampler's q holds only for the draw
    itself, not for one picked or cut by how it agrees with another source."""
    if hint is None or (drawn and model):
        return model, MODEL
    best = Proposal(MODEL, model, hint.alpha_model, drawn)
    for p in hint.proposals:
        best = pick(best, p, hint.threshold)
    return best.tokens, best.source
