"""What lookups alone would have done on the tokens drafting produced: plain decoding's
side of a batch-1 verdict, without a trial of it.

At batch 1 greedy the output is the same in every mode, so the tokens a
drafting step produced are also the tokens the draft model's "off" mode
(lookup drafts on every core) would have produced. :func:`lookup_walk` replays
that mode over them: at each position the lookup draft
(:func:`~duo_vllm.sources.lookup.find_match`), cut as the proposer would serve it,
accepted as far as it matches the context, plus the target's own token. Timed
with the measured cost of a lent step, ``T(1, e) = t0 + c·e``, it is the rate
of plain decoding on the same stretch of the same request: the gate
(:class:`~duo_vllm.control.gate.DraftGate`) compares it with drafting's measured rate
there, where it would otherwise run plain decoding on trial for 33 steps
(half as fast as drafting on most requests) on a different stretch (one such
verdict swung a batch-1 run by 16%).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from duo_vllm.sources.lookup import common_prefix, find_match


def lookup_walk(context: np.ndarray, start: int, k: int, min_n: int, max_n: int,
                cut: Callable[[int, int], int]) -> tuple[list[tuple[int, int]], int]:
    """Lookups alone from position ``start`` of ``context`` on: each step's ``(served,
    accepted)`` as far as the context tells, and the position after the last one.

    A step at position ``p`` serves ``cut(len(draft), match)`` tokens of the lookup
    draft of ``context[:p]``; ``a`` of them match what follows, and the target adds
    its own token: the step ends at ``p + a + 1``. It is told only where that token
    is in the context (``p + a < len(context)``); the walk stops before the first
    step that is not.
    """
    steps, pos, size = [], start, len(context)
    while pos < size:
        draft, match = find_match(context[:pos], k, min_n, max_n)
        served = draft[:max(0, cut(len(draft), match))] if draft.size else draft
        accepted = common_prefix(served, context[pos:])
        if pos + accepted >= size:  # its last tokens, or the target's own, not yet seen
            break
        steps.append((len(served), accepted))
        pos += accepted + 1
    return steps, pos


def walk_rate(steps: list[tuple[int, int]], t0: float, per_token: float,
              overhead: float = 0.0) -> tuple[int, float]:
    """(tokens, seconds) of a walk's steps at ``T(1, e) = t0 + per_token·e`` a step
    (``overhead``: the proposer's own time a step in that mode)."""
    tokens = sum(a + 1 for _, a in steps)
    return tokens, sum(t0 + per_token * e + overhead for e, _ in steps)


class ShadowLookups:
    """Each request's walk of lookups alone, advanced step by step over the stretches
    the gate measures (:func:`lookup_walk`)."""

    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self._walks: dict = {}  # request key -> (where its walk goes on, the context seen)

    def advance(self, key, context: np.ndarray, since: int,
                cut: Callable[[int, int], int]) -> list[tuple[int, int]]:
        """The walk's steps over ``context`` from position ``since`` on (the first token
        of the stretch measured now). Where the last stretch ended there, the walk goes
        on where it stopped (a step that began in it ends in this one); after steps
        not measured, it starts afresh at ``since``."""
        pos, seen = self._walks.get(key, (since, since))
        if seen != since:
            pos = since
        steps, pos = lookup_walk(context, pos, self.k, self.min_n, self.max_n, cut)
        self._walks[key] = pos, len(context)
        return steps

    def keep(self, keys) -> None:
        """Forget the walks of requests not in ``keys`` (finished, or preempted)."""
        keys = set(keys)
        for key in [k for k in self._walks if k not in keys]:
            del self._walks[key]
