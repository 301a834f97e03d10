"""The goodput controller: how many tokens to draft, for which request, each step.

One vLLM step over a batch of B requests, where request i gets a draft of n_i tokens:

    tokens(n)  = B + Σ_i E(α_i, n_i)         E(α, n) = α (1 - αⁿ) / (1 - α)
    seconds(n) = T(B, Σ_i n_i) + W(n)         T(B, e) = T₀(B) + c · e
    goodput    = tokens(n) / seconds(n)       floor   = B / T₀(B)  (plain decoding)

α_i is request i's measured acceptance (per token, per regime: greedy or
sampled), T₀(B) the target's measured step time at batch B, c its measured
cost per extra verified token, and W the time vLLM waits for drafts drafted
on the spot. Drafts pre-drafted while the target verified cost no wait.

Adding the j-th draft token of request i gains α_iʲ tokens for c seconds, so
it raises goodput iff α_iʲ > c · goodput. Gains fall along a draft and cost
is the same for every token, so the greedy choice of the best next token,
stopped at the first that does not pay, is optimal (:func:`plan_served`).
When nothing pays, every n_i is 0: plain decoding, and no draft work.

Everything here is a pure function of measured numbers, or a small model
that turns measurements into those numbers (:class:`StepTimeModel`,
:class:`DraftTimeModel`, :class:`Acceptance`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Callable, Sequence

GREEDY, SAMPLED = "greedy", "sampled"
PRIOR_ALPHA = {GREEDY: 0.7, SAMPLED: 0.5}
PROBE_EVERY = 16  # steps a request may go without a draft before it is probed again


def batch_bucket(batch: int) -> int:
    """Batch sizes 1, 2-3, 4-7, ... as 0, 1, 2, ...: the buckets of the step-time
    slope and of the gate."""
    return max(1, batch).bit_length() - 1


def regime(temperature: float) -> str:
    return GREEDY if temperature < 1e-5 else SAMPLED


def token_alphas(alpha: float | Sequence[float], n: int, start: int = 0) -> list[float]:
    """The acceptance of tokens ``start`` to ``start + n - 1`` of a draft, each given
    the ones before it accepted: ``alpha`` for every token of an i.i.d. draft, or the
    draft's own sequence of them (a lookup copy's, which rise as its match grows), its
    last value carried on."""
    if isinstance(alpha, Real):
        return [float(alpha)] * max(n, 0)
    last = len(alpha) - 1
    return [float(alpha[min(t, last)]) for t in range(start, start + n)] if len(alpha) else \
        [0.0] * max(n, 0)


def expected_accepted(alpha: float | Sequence[float], n: int) -> float:
    """E(α, n): expected accepted tokens of an ``n``-token draft, i.i.d. acceptance ``α``
    (or Σₜ Πₛ≤ₜ αₛ, with a sequence of per-token α, :func:`token_alphas`)."""
    if n <= 0:
        return 0.0
    if not isinstance(alpha, Real):
        total, p = 0.0, 1.0
        for a in token_alphas(alpha, n):
            p *= a
            total += p
        return total
    if alpha >= 1.0:
        return float(n)
    return alpha * (1 - alpha ** n) / (1 - alpha)


@dataclass(frozen=True)
class TargetCost:
    """T(B, e) = t0 + per_token · e for the current batch: the step that verifies e extra
    tokens."""

    t0: float  # T₀(B): a plain step at this batch size, seconds
    per_token: float  # c: seconds per extra verified token

    def step(self, extra: float) -> float:
        return self.t0 + self.per_token * extra

    def threshold(self, batch: int) -> float:
        """c · B / T₀(B): the acceptance a draft token needs to raise plain decoding's
        goodput B / T₀(B) (:func:`pays`)."""
        return self.per_token * batch / self.t0


def plan_served(alphas: Sequence[float], available: Sequence[int], cost: TargetCost,
                base_tokens: float | None = None) -> list[int]:
    """Tokens to serve per request from drafts that cost no wait (pre-drafted).

    Greedy on marginal gain: the next token of the request whose next token is
    most likely accepted, while α_iʲ > c · goodput. ``available[i]`` caps n_i.
    """
    n = [0] * len(alphas)
    tokens = float(len(alphas) if base_tokens is None else base_tokens)
    extra = 0
    while True:
        best, gain = -1, 0.0
        for i, (a, cap) in enumerate(zip(alphas, available)):
            if n[i] < cap and a ** (n[i] + 1) > gain:
                best, gain = i, a ** (n[i] + 1)
        if best < 0 or not pays(gain, tokens / cost.step(extra), cost):
            return n
        n[best] += 1
        tokens += gain
        extra += 1


def pays(gain: float, rate: float, cost: TargetCost) -> bool:
    """Does a draft token with expected gain ``gain`` raise a goodput of ``rate``?"""
    return gain > cost.per_token * rate


@dataclass(frozen=True)
class SyncPlan:
    rows: tuple[int, ...]  # indices into the candidates, drafted on the spot
    depth: int  # tokens drafted for each of them (capped per request)
    wait_s: float  # predicted wait for those drafts


def plan_sync(alphas: Sequence[float], caps: Sequence[int], catch_up: Sequence[int],
              cost: TargetCost, draft_time: Callable[[int], float],
              base_tokens: float, base_extra: int,
              fallback: Sequence[tuple[float, int]] | None = None) -> SyncPlan:
    """Draft now, while vLLM waits, for requests without a pre-draft?

    The candidates (with their ``catch_up`` tokens to evaluate first) are
    taken most-gaining first: the m best drafted to depth d cost
    D(Σ catch-up) + (d - 1) · D(m) of waiting. The (m, d) with the best
    goodput wins; (0, 0) when none beats ``base`` (the rest of the step).

    ``fallback[i]`` = (expected accepted tokens, tokens verified) of what
    candidate i is served without drafting: a lookup draft, free. It is in
    ``base``; a candidate drafted now serves the model's draft instead, so it
    gains E(α_i, d) - fallback, not E(α_i, d): a request whose context
    already offers a good copy is not worth a wait.
    """
    fb = list(fallback) if fallback is not None else [(0.0, 0)] * len(alphas)
    order = sorted(range(len(alphas)),
                   key=lambda i: -(expected_accepted(alphas[i], caps[i]) - fb[i][0]))
    best = SyncPlan((), 0, 0.0)
    best_rate = base_tokens / cost.step(base_extra)
    k = max(caps, default=0)
    for m in range(1, len(order) + 1):
        rows = order[:m]
        first = draft_time(sum(max(1, catch_up[i]) for i in rows))
        for d in range(1, k + 1):
            n = [min(d, caps[i]) for i in rows]
            wait = first + (d - 1) * draft_time(m)
            tokens = base_tokens + sum(expected_accepted(alphas[i], x) - fb[i][0]
                                       for i, x in zip(rows, n))
            extra = base_extra + sum(x - fb[i][1] for i, x in zip(rows, n))
            rate = tokens / (cost.step(extra) + wait)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = SyncPlan(tuple(rows), d, wait), rate
    return best


CATCH_UP_SHARE = 0.5  # the most of a request's remaining life its draft's catch-up may take


def catch_up_pays(tokens: int, prefill_s: float, remaining: int | None,
                  step_s: float) -> bool:
    """Start a background catch-up of ``tokens`` context tokens (``prefill_s`` each on
    the draft) for a request with ``remaining`` tokens left to generate (``None``:
    unknown), at ``step_s`` per target step? The draft serves the request nothing
    until it has caught up, while the request decodes one token a step at least: the
    catch-up must end well within what is left of it (a request the draft never saw,
    at the tail of a batch that drained from one where drafting was off)."""
    if remaining is None:
        return True
    return tokens * prefill_s <= CATCH_UP_SHARE * max(remaining, 0) * step_s


def predraft_time(depths: Sequence[int], catch_up: Sequence[int],
                  draft_time: Callable[[int], float]) -> float:
    """Draft time of a pre-draft: one catch-up call, then one call per depth level."""
    live = [i for i, m in enumerate(depths) if m > 0]
    if not live:
        return 0.0
    width = sum(catch_up[i] for i in live)
    t = draft_time(width) if width else 0.0
    for level in range(1, max(depths) + 1):
        t += draft_time(sum(1 for m in depths if m >= level))
    return t


def predraft_root(n: int, agree: int, alpha: float, alpha_lookup: float | Sequence[float],
                  greedy: bool = True) -> tuple[int, float]:
    """Where the next step's pre-draft starts, for a request served ``n`` tokens of
    which the draft model drafted the first ``agree`` and a lookup copied the rest
    (accepted at ``alpha_lookup`` a token, or per token as :func:`token_alphas`
    reads it; the model at ``alpha``): (tokens of the served draft the root holds,
    the chance the target's tokens reach it).

    Rooted after the whole draft, its branches are reached when the target
    accepts all of it; rooted where the copy parts from the model, the model's
    own next token there is taken when the target turns the copied one down:

        p_end  = α^agree · Π α_l,t (t = agree .. n-1)
        p_part = α^agree · min(α, 1 - α_l,agree) / α

    The likelier of the two; after the whole draft where nothing was copied, or
    for a sampled request (not ``greedy``: its drafts are drawn, not copied).
    """
    tail = token_alphas(alpha_lookup, n - agree, agree)
    end = (n, alpha ** agree * math.prod(tail))
    if not greedy or agree >= n:
        return end
    part = (agree, alpha ** agree * min(1.0, (1.0 - token_alphas(alpha_lookup, 1, agree)[0])
                                        / max(alpha, 1e-9)))
    return part if part[1] > end[1] else end


def plan_predraft(alphas: Sequence[float], hit_probs: Sequence[float], caps: Sequence[int],
                  catch_up: Sequence[int], budget_s: float,
                  draft_time: Callable[[int], float], min_gain: float) -> list[int]:
    """Depth of each request's pre-draft, to be ready when the target's step ends.

    The j-th pre-drafted token of request i is worth p_i · α_iʲ (``p_i``: the
    chance the pre-draft is used at all). Greedy by worth per second of draft
    time, within ``budget_s`` (the target's expected step); a token worth less
    than ``min_gain`` would not be served (:func:`pays`), so it is not drafted.
    """
    m = [0] * len(alphas)
    spent = 0.0
    while True:
        best, best_score, best_t = -1, 0.0, 0.0
        for i, (a, p, cap) in enumerate(zip(alphas, hit_probs, caps)):
            if m[i] >= cap:
                continue
            worth = p * a ** (m[i] + 1)
            if worth <= min_gain:
                continue
            m[i] += 1
            t = predraft_time(m, catch_up, draft_time)
            m[i] -= 1
            if t > budget_s:
                continue
            score = worth / max(t - spent, 1e-6)
            if score > best_score:
                best, best_score, best_t = i, score, t
        if best < 0:
            return m
        m[best] += 1
        spent = best_t


# --- measured costs ---------------------------------------------------------------------------

class StepTimeModel:
    """T(B, e) = T₀(B) + c(B) · e, fitted to observed steps (least squares with forgetting).

    One fit per batch size B gives T₀(B). The slope c(B) is pooled over the
    batch sizes of B's bucket (1, 2-3, 4-7, ...; within-B variation only),
    since few steps at one B vary e much, and a verified token costs more in
    a wide batch than in a narrow one (on a CPU target a step of 16 requests
    is compute-bound, a step of one is not). A bucket that has not seen e
    vary borrows the slope pooled over every batch size.
    """

    def __init__(self, decay: float = 0.97, prior_per_token: float = 0.1):
        self.decay = decay
        self.prior_per_token = prior_per_token  # c as a fraction of T₀ until measured
        self._sums: dict[int, list[float]] = {}  # B -> [w, Σx, Σy, Σxx, Σxy]

    def observe(self, batch: int, extra: int, seconds: float) -> None:
        s = self._sums.setdefault(batch, [0.0] * 5)
        for j in range(5):
            s[j] *= self.decay
        s[0] += 1
        s[1] += extra
        s[2] += seconds
        s[3] += extra * extra
        s[4] += extra * seconds

    def per_token(self, batch: int | None = None) -> float | None:
        """Slope c pooled over ``batch``'s bucket (over every batch size when ``None``,
        or when the bucket has not seen e vary); ``None`` while nothing has."""
        if batch is not None:
            b = batch_bucket(batch)
            c = _pooled_slope(s for B, s in self._sums.items() if batch_bucket(B) == b)
            if c is not None:
                return c
        return _pooled_slope(self._sums.values())

    def cost(self, batch: int) -> TargetCost | None:
        """T(B, ·) for ``batch``; ``None`` before any step was seen.

        A verified token costs no more than a whole step: c ≤ T₀ = my - c·mx,
        i.e. c ≤ my / (1 + mx). A slope past that (a few disturbed deep-draft
        steps, or one borrowed from wider batches) is no measurement, and it
        would put T₀ near 0, where no draft pays and so no step with drafts
        comes to correct it: the prior slope stands in, as before any was known.
        """
        if not self._sums:
            return None
        c = self.per_token(batch)
        if batch in self._sums and self._sums[batch][0] > 0:
            w, sx, sy, _, _ = self._sums[batch]
            mx, my = sx / w, sy / w
            if c is None or c > my / (1 + mx):
                c = self.prior_per_token * my / (1 + self.prior_per_token * mx)
            return TargetCost(max(my - c * mx, 1e-4), c)
        # unseen batch size: the nearest seen one, plus or minus a token per request
        # (a narrower batch costs at least its share of the wider one's step)
        near = self._nearest(batch)
        base = self.cost(near)
        step = base.per_token if c is None else c
        t0 = max(base.t0 + (batch - near) * step, base.t0 * min(1.0, batch / near), 1e-4)
        return TargetCost(t0, min(base.per_token, t0))

    def mean(self, batch: int) -> float | None:
        """The (forgetting) mean of the steps seen at ``batch`` (at the nearest batch
        size seen, for one not seen yet); ``None`` before any step."""
        if not self._sums:
            return None
        s = self._sums.get(batch) or self._sums[self._nearest(batch)]
        return s[2] / s[0] if s[0] > 0 else None

    def _nearest(self, batch: int) -> int:
        """The seen batch size nearest ``batch`` (some step was seen)."""
        return min(self._sums, key=lambda b: abs(b - batch))

    def batch_sizes(self) -> list[int]:
        """The batch sizes seen so far."""
        return sorted(self._sums)

    def predict(self, batch: int, extra: int) -> float | None:
        cost = self.cost(batch)
        return None if cost is None else cost.step(extra)


def _pooled_slope(sums) -> float | None:
    """The least-squares slope of seconds on extra tokens, pooled over fits (within-fit
    variation only); ``None`` with less than about one token of spread in all."""
    cov = var = 0.0
    for w, sx, sy, sxx, sxy in sums:
        if w <= 0:
            continue
        var += sxx - sx * sx / w
        cov += sxy - sx * sy / w
    if var < 1.0:
        return None
    return max(0.0, cov / var)


class DraftTimeModel:
    """D(w): draft time of one decode call of w tokens, measured per width (EMA).

    Widths not seen yet are interpolated between the nearest seen ones,
    scaled per token beyond the widest, and below the narrowest taken on the
    line through the two narrowest (:meth:`_below`); ``prior`` before any.
    D is kept non-decreasing in w: a call of w tokens bounds every narrower
    width's estimate. Otherwise a width whose last calls were slow (the
    draft's cold first calls) keeps that estimate for as long as no call of
    that width runs, and one planned from it may never run again.
    """

    def __init__(self, prior_s: float = 0.015, weight: float = 0.2):
        self.prior_s, self.weight = prior_s, weight
        self._by_width: dict[int, float] = {}

    @staticmethod
    def bucket(width: int) -> int:
        """Exact widths up to 16, then powers of two (prefill chunks)."""
        return width if width <= 16 else 1 << math.ceil(math.log2(width))

    def observe(self, width: int, seconds: float) -> None:
        b = self.bucket(max(1, width))
        per = seconds * b / max(1, width)  # normalise to the bucket's width
        old = self._by_width.get(b)
        self._by_width[b] = now = per if old is None else old + self.weight * (per - old)
        for w, t in self._by_width.items():
            if w < b and t > now:
                self._by_width[w] = now

    def __call__(self, width: int) -> float:
        if width <= 0:
            return 0.0
        if not self._by_width:
            return self.prior_s * width
        ws = sorted(self._by_width)
        if width in self._by_width:
            return self._by_width[width]
        lo = max((w for w in ws if w < width), default=None)
        hi = min((w for w in ws if w > width), default=None)
        if lo is not None and hi is not None:
            f = (width - lo) / (hi - lo)
            return self._by_width[lo] + f * (self._by_width[hi] - self._by_width[lo])
        near = lo if lo is not None else hi
        if near > width:  # below every measured width
            return self._below(width, ws)
        return self._by_width[near] * width / near

    def _below(self, width: int, ws: list[int]) -> float:
        """D(w) under the narrowest measured width: along the line through the two
        narrowest, D = a + b·w (a call's fixed cost a, b per token), and never below
        per token of the narrowest (with only prefill chunks measured, an estimate
        too high would plan no pre-draft, so no narrow call would ever correct it).
        With one width measured: half of it, at least per token."""
        w0 = ws[0]
        d0 = self._by_width[w0]
        per_token = d0 * width / w0
        if len(ws) < 2:
            return max(d0 * 0.5, per_token)
        w1 = ws[1]
        slope = (self._by_width[w1] - d0) / (w1 - w0)
        return max(d0 - slope * (w0 - width), per_token)

    def table(self) -> dict[int, float]:
        return dict(sorted(self._by_width.items()))


class Acceptance:
    """Per-token acceptance α, per request and per regime (greedy or sampled).

    A draft of n tokens of which a were accepted is a + [a < n] Bernoulli
    trials with a successes (each draft token is tried until the first
    rejection). Counts decay so α follows a request's drift. A request's α
    starts from its regime's α (``prior_weight`` trials of it).
    """

    def __init__(self, decay: float = 0.9, prior_weight: float = 4.0,
                 prior: dict[str, float] | None = None):
        self.decay, self.prior_weight = decay, prior_weight
        self.prior = PRIOR_ALPHA if prior is None else prior
        self._regime = {r: [0.0, 0.0] for r in PRIOR_ALPHA}  # successes, trials
        self._requests: dict[object, list[float]] = {}

    def observe(self, key, reg: str, accepted: int, proposed: int) -> None:
        if proposed <= 0:
            return
        trials = accepted + (1 if accepted < proposed else 0)
        g = self._regime[reg]
        g[0] = 0.98 * g[0] + accepted
        g[1] = 0.98 * g[1] + trials
        r = self._requests.setdefault(key, [0.0, 0.0])
        r[0] = self.decay * r[0] + accepted
        r[1] = self.decay * r[1] + trials

    def regime_alpha(self, reg: str) -> float:
        s, t = self._regime[reg]
        w = self.prior_weight
        return (s + w * self.prior[reg]) / (t + w)

    def alpha(self, key, reg: str) -> float:
        s, t = self._requests.get(key, (0.0, 0.0))
        w = self.prior_weight
        return min(0.99, (s + w * self.regime_alpha(reg)) / (t + w))

    def forget(self, key) -> None:
        self._requests.pop(key, None)
