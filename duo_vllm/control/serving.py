"""What a row is served: its model draft, its lookup draft, or a mix, each token
only while its chance of acceptance pays for its verification.

Per request and step :func:`combine` serves one draft: where the two agree, the
longer; where they differ, the source more likely accepted. A lookup tail is then cut
by :func:`paying_length` to the tokens whose acceptance beats c · goodput
(:func:`duo_vllm.control.goodput.pays`). The proposer serves :func:`serve`; the
drafter computes the same (from a :class:`Hint`) and pre-drafts from its end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from duo_vllm.control.goodput import token_alphas
from duo_vllm.control.verdict import LOOKUP, MODEL


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if int(x) != int(y):
            break
        n += 1
    return n


def combine(model: list[int], lookup: list[int], alpha_model: float,
            alpha_lookup: float | Sequence[float]) -> tuple[list[int], str]:
    """The draft to serve from a draft-model draft and a lookup draft, and its source.

    Where one is a prefix of the other they agree: serve the longer. Where they
    part, serve the source whose token there is more likely accepted
    (``alpha_lookup``: per token of the copy, or one α for all).
    """
    if not lookup:
        return model, MODEL
    if not model:
        return lookup, LOOKUP
    agree = common_prefix(model, lookup)
    if agree == len(model) or agree == len(lookup):
        return (lookup, LOOKUP) if len(lookup) > len(model) else (model, MODEL)
    return (lookup, LOOKUP) if token_alphas(alpha_lookup, 1, agree)[0] > alpha_model \
        else (model, MODEL)


@dataclass(frozen=True)
class Hint:
    """A row's lookup draft and the inputs of :func:`choose`, for the drafter.

    The proposer serves ``choose(model_draft, tokens, alpha_model,
    alpha_lookup, threshold)``; the drafter, which makes the model draft,
    computes the same and pre-drafts from its end.
    """

    tokens: list
    alpha_model: float
    alpha_lookup: float | tuple  # per token of ``tokens`` (MatchAcceptance.alphas)
    threshold: float


def paying_length(lead: float, alpha: float | Sequence[float], n: int, threshold: float,
                  start: int = 0) -> int:
    """Tokens of an ``n``-token lookup tail worth verifying.

    Its t-th token is accepted with probability ``lead`` · α₁ ··· αₜ (``lead``:
    the chance the draft tokens before the tail are all accepted; the α of the
    copy's tokens ``start`` on, :func:`~duo_vllm.control.goodput.token_alphas`) and
    pays while that beats ``threshold`` = c · goodput
    (:func:`duo_vllm.control.goodput.pays`).
    """
    t, p = 0, lead
    for a in token_alphas(alpha, n, start):
        if p * a <= threshold:
            break
        t, p = t + 1, p * a
    return t


def choose(model: list[int], lookup: list[int], alpha_model: float,
           alpha_lookup: float | Sequence[float], threshold: float) -> tuple[list[int], str]:
    """:func:`combine`, with a lookup tail cut to what pays for its verification."""
    draft, source = combine(model, lookup, alpha_model, alpha_lookup)
    if source != LOOKUP:
        return draft, source
    agree = common_prefix(model, lookup)
    if agree == len(model):  # the model's draft, extended by the lookup's tail
        n = agree + paying_length(alpha_model ** agree, alpha_lookup, len(draft) - agree,
                                  threshold, start=agree)
        if model and n <= len(model):
            return model, MODEL
        return draft[:n], LOOKUP
    n = paying_length(1.0, alpha_lookup, len(draft), threshold)  # they part: the lookup's own
    return (draft[:n], LOOKUP) if n else (model, MODEL)


def serve(model: list[int], drawn: bool, hint: Hint | None) -> tuple[list[int], str]:
    """What a row is served: its model draft and lookup draft combined by :func:`choose`.

    A model draft ``drawn`` from the draft's q (a sampled request,
    :mod:`duo_vllm.draft.sampling`) is served as it is whenever it has tokens: the
    rejection sampler reads its q, which holds only for the draw itself, not
    for a draw picked or cut by how it agrees with the lookup draft.
    """
    if hint is None or not hint.tokens or (drawn and model):
        return model, MODEL
    return choose(model, hint.tokens, hint.alpha_model, hint.alpha_lookup, hint.threshold)
