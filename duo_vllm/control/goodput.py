"""The goodput controller: how many tokens to draft, for which request, each step.

One vLLM step over a batch of B requests, where request i gets a draft of n_i tokens:

    tokens(n)  = B + Σ_i E(α_i, n_i)         E(α, n) = α (1 - αⁿ) / (1 - α)
    seconds(n) = T(B, Σ_i n_i) + W(n)         T(B, e) = T₀(B) + c · e
    goodput    = tokens(n) / seconds(n)       floor   = B / T₀(B)  (plain decoding)

α_i: request i's measured acceptance per token (greedy or sampled); T₀(B): the target's
measured plain step; c: its cost per extra verified token; W: the wait for drafts drafted
on the spot (pre-drafted ones cost none). The j-th draft token of request i gains α_iʲ
tokens for c seconds, so it pays iff α_iʲ > c · goodput; gains fall along a draft, so
taking the best next token until one does not pay is optimal (:func:`plan_served`).
When nothing pays, every n_i is 0: plain decoding, and no draft work.
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
    """Batch sizes 1, 2-3, 4-7, ... as 0, 1, 2, ... (the step-time slope's and gate's)."""
    return max(1, batch).bit_length() - 1


def regime(temperature: float) -> str:
    return GREEDY if temperature < 1e-5 else SAMPLED


def token_alphas(alpha: float | Sequence[float], n: int, start: int = 0) -> list[float]:
    """The acceptance of draft tokens ``start`` to ``start + n - 1``: ``alpha`` for each, or
    read from a per-token sequence (a lookup copy's), its last value carried on."""
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
    """T(B, e) = t0 + per_token · e: the current batch's step verifying e extra tokens."""

    t0: float  # T₀(B): a plain step at this batch size, seconds
    per_token: float  # c: seconds per extra verified token

    def step(self, extra: float) -> float:
        return self.t0 + self.per_token * extra

    def threshold(self, batch: int) -> float:
        """c · B / T₀(B): the acceptance a draft token needs to beat plain decoding."""
        return self.per_token * batch / self.t0


def plan_served(alphas: Sequence[float], available: Sequence[int], cost: TargetCost,
                base_tokens: float | None = None) -> list[int]:
    """Tokens to serve per request from pre-drafted drafts (no wait), capped by
    ``available``: greedy on the likeliest next token while α_iʲ > c · goodput."""
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


def plan_sync(alphas: Sequence[float], caps: Sequence[int], catch_up: Sequence[int],
              cost: TargetCost, draft_time: Callable[[int], float],
              base_tokens: float, base_extra: int,
              fallback: Sequence[tuple[float, int]] | None = None) -> SyncPlan:
    """Draft now, while vLLM waits, for requests without a pre-draft? The m most-gaining
    candidates drafted to depth d wait D(Σ ``catch_up``) + (d - 1) · D(m); the (m, d) of best
    goodput wins, (0, 0) where none beats ``base`` (the rest of the step). ``fallback[i]``:
    (expected accepted, verified) of candidate i's free lookup draft, counted in ``base``;
    drafting replaces it, so it gains E(α_i, d) - fallback."""
    fb = list(fallback) if fallback is not None else [(0.0, 0)] * len(alphas)
    order = sorted(range(len(alphas)),
                   key=lambda i: -(expected_accepted(alphas[i], caps[i]) - fb[i][0]))
    best = SyncPlan((), 0)
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
                best, best_rate = SyncPlan(tuple(rows), d), rate
    return best


CATCH_UP_SHARE = 0.5  # the most of a request's remaining life its draft's catch-up may take


def catch_up_pays(tokens: int, prefill_s: float, remaining: int | None,
                  step_s: float) -> bool:
    """Catch the draft up on ``tokens`` context tokens (``prefill_s`` each) of a request with
    ``remaining`` tokens left (``None``: unknown), at ``step_s`` a target step? Only where
    it ends well within the request's remaining life: until then the draft serves it nothing."""
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
    """Where the next pre-draft starts, for a request served ``n`` tokens, the first
    ``agree`` the model's (acceptance ``alpha``), the rest a lookup's (``alpha_lookup``):
    (tokens of the served draft the root holds, the chance the target's tokens reach it).
    After the whole draft (p_end = α^agree · Π α_l,t, t = agree .. n-1), or where the copy
    parts from the model, whose own next token is taken when the target rejects the
    copied one (p_part = α^agree · min(α, 1 - α_l,agree) / α): the likelier; always after
    the whole draft where nothing was copied or for a sampled request (drawn, not copied).
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
    """Depth of each request's pre-draft, ready when the target's step ends: greedy by
    worth per second of draft time within ``budget_s``, the j-th token of request i worth
    p_i · α_iʲ (p_i: ``hit_probs``, the chance the pre-draft is used), none under
    ``min_gain`` (it would not be served)."""
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
    """T(B, e) = T₀(B) + c(B) · e, fitted to observed steps (least squares with forgetting):
    T₀ per batch size B, the slope c(B) pooled over B's bucket (:func:`batch_bucket`), as few
    steps at one B vary e much and a verified token costs more in a wide batch; a bucket
    that has not seen e vary borrows the overall slope."""

    def __init__(self, decay: float = 0.97, prior_per_token: float = 0.1):
        self.decay = decay
        self.prior_per_token = prior_per_token  # c as a fraction of T₀ until measured
        self._sums: dict[int, list[float]] = {}  # B -> [w, Σx, Σy, Σxx, Σxy]

    def observe(self, batch: int, extra: int, seconds: float) -> None:
        s = self._sums.setdefault(batch, [0.0] * 5)
        for j, x in enumerate((1, extra, seconds, extra * extra, extra * seconds)):
            s[j] = s[j] * self.decay + x

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

        A verified token costs no more than a step (c ≤ my / (1 + mx)); a slope past that is
        no measurement and would put T₀ near 0, where no draft pays to correct it: the prior
        slope stands in."""
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
    """D(w): draft time of one decode call of w tokens, measured per width (EMA); unseen
    widths interpolated, scaled per token beyond the widest, below the narrowest
    :meth:`_below`; ``prior`` before any. D is kept non-decreasing in w, so a slow width
    (cold first calls) that is never run again cannot keep its estimate."""

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
        t, ws = self._by_width, sorted(self._by_width)
        if width in t:
            return t[width]
        lo = max((w for w in ws if w < width), default=None)
        hi = min((w for w in ws if w > width), default=None)
        if lo is None:  # below every measured width
            return self._below(width, ws)
        if hi is None:  # beyond the widest: per token
            return t[lo] * width / lo
        return t[lo] + (width - lo) / (hi - lo) * (t[hi] - t[lo])

    def _below(self, width: int, ws: list[int]) -> float:
        """D(w) under the narrowest measured width: on the line through the two narrowest
        (half the narrowest, with one), never below its per-token time (an estimate too
        high would plan no narrow call to correct it)."""
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
    """Per-token acceptance α, per request and per regime (greedy or sampled): a draft of n
    tokens with a accepted is a + [a < n] trials, a successes; counts decay so α follows
    drift. A request's α starts from its regime's (``prior_weight`` trials of it)."""

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
        request = self._requests.setdefault(key, [0.0, 0.0])
        for counts, decay in ((self._regime[reg], 0.98), (request, self.decay)):
            counts[0] = decay * counts[0] + accepted
            counts[1] = decay * counts[1] + trials

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
