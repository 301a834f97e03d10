"""Free draft tokens: copy what followed the context's last n-gram earlier on.

Numpy, not vLLM's numba ``ngram_proposer``: numba's objects in ``sys.modules``
break vLLM's CPU kernel-override scan when an engine starts later in the process.
"""

from __future__ import annotations

import numpy as np

from duo_vllm.control.goodput import Acceptance
from duo_vllm.control.verdict import LOOKUP
from duo_vllm.sources.base import Proposal, register

# a lookup draft's acceptance is kept per class of the length of the match it follows
MATCH_CLASSES = (1, 2, 3, 4, 6)
# before any measurement, per class: a longer match is likelier to be copied on correctly
LOOKUP_PRIOR = {1: {"greedy": 0.3, "sampled": 0.2}, 2: {"greedy": 0.4, "sampled": 0.3},
                3: {"greedy": 0.55, "sampled": 0.4}, 4: {"greedy": 0.65, "sampled": 0.5},
                6: {"greedy": 0.8, "sampled": 0.6}}


def match_class(n: int) -> int:
    """The class of a match of ``n`` tokens: the last of MATCH_CLASSES <= n."""
    return max((c for c in MATCH_CLASSES if c <= n), default=MATCH_CLASSES[0])


def find_continuation(context: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """:func:`find_match`'s tokens, without the match's length."""
    return find_match(context, k, min_n, max_n)[0]


def find_match(context: np.ndarray, k: int, min_n: int, max_n: int) -> tuple[np.ndarray, int]:
    """Up to ``k`` tokens that followed the longest earlier occurrence (``min_n`` to
    ``max_n`` tokens, the most recent of equals) of the context's suffix, and that
    occurrence's length; empty and 0 when there is none."""
    size = len(context)
    if k <= 0 or size < min_n + 1:
        return context[:0], 0
    # where an occurrence may end, narrowed as the match grows back (never the suffix itself)
    ends = np.flatnonzero(context[:-1] == context[-1])
    n = 1
    while n < max_n and ends.size:
        room = ends[ends >= n]  # an occurrence cannot reach back before the start
        longer = room[context[room - n] == context[size - 1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if n < min_n or not ends.size:
        return context[:0], 0
    e = int(ends[-1])
    # a continuation that runs into the context's end repeats with the match's period
    return context[e + 1 + np.arange(k) % (size - 1 - e)], n


class MatchAcceptance:
    """Lookup acceptance per request, regime and class of match length (its own prior)."""

    def __init__(self):
        self.by_class = {c: Acceptance(prior=LOOKUP_PRIOR[c]) for c in MATCH_CLASSES}

    def observe(self, key, reg: str, match: int, accepted: int, proposed: int) -> None:
        """A copy after a ``match``-token match: its token t was tried after ``match + t``.
        Each class gets one observation a copy (its counts decay once a copy)."""
        trials: dict[int, list[int]] = {}  # class -> [accepted, judged]
        for t in range(min(accepted + 1, proposed)):
            c = trials.setdefault(match_class(match + t), [0, 0])
            c[0] += t < accepted
            c[1] += 1
        for cls, (ok, judged) in trials.items():
            self.by_class[cls].observe(key, reg, ok, judged)

    def alpha(self, key, reg: str, match: int) -> float:
        return self.by_class[match_class(match)].alpha(key, reg)

    def alphas(self, key, reg: str, match: int, n: int) -> tuple[float, ...]:
        """The α of each of the ``n`` tokens of a copy after a ``match``-token match
        (given those before accepted, its match has grown)."""
        return tuple(self.alpha(key, reg, match + t) for t in range(n))

    def forget(self, key) -> None:
        for a in self.by_class.values():
            a.forget(key)

    def regime_alpha(self, reg: str) -> dict[int, float]:
        return {c: a.regime_alpha(reg) for c, a in self.by_class.items()}


@register(LOOKUP)
class ContextLookup:
    """Drafts copied from the request's own context (:func:`find_match`)."""

    def __init__(self, min_n: int = 2, max_n: int = 8):
        self.min_n, self.max_n = min_n, max_n
        self.acceptance = MatchAcceptance()
        self.rows = 0  # rows with a match

    @staticmethod
    def enabled(config) -> bool:
        return bool(config.lookup)

    def begin(self, key) -> None:
        pass

    def draft(self, key, context, k: int, reg: str) -> Proposal:
        tokens, n = find_match(context, k, self.min_n, self.max_n)
        self.rows += bool(tokens.size)
        return Proposal(LOOKUP, tokens.tolist(),
                        self.acceptance.alphas(key, reg, n, len(tokens)), meta=n)

    def accept(self, key, reg: str, proposal: Proposal, accepted: int, judged: int) -> None:
        self.acceptance.observe(key, reg, proposal.meta or 0, accepted, judged)

    def end(self, key) -> None:
        self.acceptance.forget(key)

    def alpha(self, key, reg: str, match: int = 0) -> float:
        return self.acceptance.alpha(key, reg, match)

    def summary(self) -> dict:
        return {"lookup_rows": self.rows,
                "lookup_alpha_greedy": self.acceptance.regime_alpha("greedy")}  # by match
