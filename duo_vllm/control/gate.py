"""Measured, not modelled: is drafting faster than plain decoding at this batch size?

The controller of :mod:`duo_vllm.control.goodput` plans each step on a model (T, D,
α); :class:`DraftGate` checks its outcome in realised tokens per second,
with the draft model on and off, per batch-size bucket.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from duo_vllm.control.goodput import batch_bucket


def drafting_wins(r_on: float | None, r_off: float | None, margin: float,
                  tie_on: bool) -> bool:
    """Is drafting's rate ``r_on`` the faster of the two (``None``: never measured)?
    Within ``margin`` of each other the two tie, and a tie goes to drafting where
    ``tie_on``."""
    if r_on is None or r_off is None:
        return r_on is not None or r_off is None
    return r_on * (1 + margin) > r_off if tie_on else r_on > r_off * (1 + margin)


def close(r_a: float | None, r_b: float | None, within: float) -> bool:
    """Are two measured rates within ``within`` (a share) of each other?"""
    return r_a is not None and r_b is not None and \
        max(r_a, r_b) <= (1 + within) * min(r_a, r_b)


def _add_step(sums: list, tokens: float, seconds: float) -> None:
    """Add a step to plain (undecayed) sums: [tokens, seconds, steps]."""
    sums[0] += tokens
    sums[1] += seconds
    sums[2] += 1


class _GateRates:
    """What both gates measure and log: per batch-size bucket and mode, tokens per
    second over the mode's recent steps (sums that decay by ``1 - weight`` a step),
    a step's tokens counted per request at the bucket's smallest batch size."""

    labels = ("on", "off")  # the two modes' names in :meth:`rates`

    @staticmethod
    def bucket(batch: int, sampled: bool = False) -> tuple[int, bool]:
        """Batch sizes 1, 2-3, 4-7, ...; all-greedy steps apart from those with sampling."""
        return batch_bucket(batch), bool(sampled)

    @staticmethod
    def _per_request(b, batch: int, tokens: float) -> float:
        """A step's ``tokens`` per request, at bucket ``b``'s smallest batch size."""
        return tokens * (1 << b[0]) / batch

    def _record(self, b, on: bool, tokens: float, seconds: float) -> None:
        """Add a step (``tokens`` already per request) to mode ``on``'s decayed sums in
        bucket ``b``; its rate is their ratio."""
        mode = (b, bool(on))
        sums = self._sums.setdefault(mode, [0.0, 0.0])
        sums[0] = (1 - self.weight) * sums[0] + tokens
        sums[1] = (1 - self.weight) * sums[1] + seconds
        self._rate[mode] = sums[0] / sums[1]

    def _note(self, b, on: bool, how: str, *rates) -> None:
        """Log a trial or a verdict: (bucket's step, bucket, mode, how, the rates)."""
        size, sampled = b
        self.log.append((self._clock.get(b, 0), f"{1 << size}{'s' if sampled else ''}",
                         self.labels[0 if on else 1], how,
                         *(None if r is None else round(r, 1) for r in rates)))

    def _next_request(self, b, key) -> bool:
        """Does request ``key`` follow the one a verdict for plain decoding in bucket
        ``b`` was scoped to (``self._scope``: bucket -> that request)?"""
        return key is not None and self._scope.get(b, key) != key

    def rates(self) -> dict[str, float]:
        return {f"{1 << b}{'s' if sampled else ''}+{self.labels[0 if on else 1]}": r
                for ((b, sampled), on), r in sorted(self._rate.items())}


class DraftGate(_GateRates):
    """Is drafting faster than plain decoding at this batch size? Measured, not modelled.

    The controller's plan rests on a model (T, D, α); this gate checks its
    outcome. Per batch-size bucket (1, 2-3, 4-7, ...; steps where some
    request samples apart from all-greedy ones) it keeps the realised
    goodput with drafting on and off, tokens produced over the seconds they
    took across the mode's recent steps (sums that decay by ``1 - weight``
    a step: a ratio of sums, not an average of per-step ratios, so a short
    run of slow steps weighs what it cost), and drafts only while on is the
    faster of the two. A step's tokens count per request, times the bucket's
    smallest batch size (a step of 9 requests in bucket 8-15 counts 8/9 of
    its tokens): plain decoding makes 185 tokens/s at batch 9 and 228 at 12
    here, so a trial that runs as a batch drains would otherwise be judged
    against a mode measured wider (lookups at 12-15 once "beat" plain
    decoding at 9 by 34%, at the same speed per request). Each mode runs
    ``trial_steps`` before it is judged (the first ``warmup_steps`` after
    turning drafting on are not counted: the draft catches up), and the
    slower mode is tried again every ``retry_every`` steps of the bucket, so
    the gate follows the traffic and the hardware. A new bucket starts in the
    mode that won at the nearest smaller judged one; where that was plain
    decoding, or drafting but more than ``reach`` buckets below, it starts
    plain and waits as long for its first trial of drafting (a server does not
    pay a trial at each new batch size where drafting is unlikely to pay). Where
    no smaller one is judged yet, drafting counts as batch 1's winner.
    Modes change only at the end of a trial: a dip between trials (the steps while the draft
    prefills a new long prompt, say) does not turn drafting off until the next trial.
    A trial the traffic leaves (its batch size not seen again within
    ``abandon_after`` trial lengths of steps, as batch 16 drains to batch 8-15 in
    a few dozen steps) ends there: where it measured at least ``judge_after`` of a
    trial length of steps it is judged on its rates like any trial (plain
    decoding's trial at batch 16 once measured 236 against lookups' 228 tokens/s
    over 7 steps, was dropped, and lookups held the next burst at 0.86x plain
    vLLM); where it measured less its bucket goes back to the mode before it. Either
    way the bucket waits a retry interval, rather than keep the mode on trial for good.

    Steps that carry a ``key`` (the proposer passes the request at batch 1)
    are also summed per key: a trial is judged against the other mode on the
    same request where both ran at least ``paired_steps`` steps on it. At
    batch 1 one request follows another, and a trial that fell on a request
    that copies its prompt (fast in any mode) must not beat drafting measured
    on a harder one. Such a paired verdict against drafting speaks for its own
    request: when the next one starts (``drafting`` is told the step's
    ``key``), drafting is on trial again there, and plain decoding holds only
    if it still wins (one hard request, a long article the draft cannot
    follow, does not keep drafting off for the requests after it). So does a
    verdict for plain decoding on the rates where no request ran both modes long
    enough to pair (its trial ran across a request boundary, say): it holds for
    the request it ended on, the rates having been measured partly on others.
    Unless the recent rates, measured on the requests before (easier ones,
    or harder), favour drafting by more than ``pair_within``, plain decoding's
    trial follows on the same request, and the verdict is paired on it. Where
    plain decoding wins on several requests in a row, the requests after its
    n-th win in a row are left to it, 2ⁿ⁻¹ - 1 of them, before drafting's next
    trial: a server where the draft never pays spends trials on a vanishing
    share of its requests, and one whose requests come in kinds (two that
    quote their prompt, then ones only the draft makes fast) gets drafting
    back after a request or two, not after a retry interval (223 steps once).

    A trial has to beat the mode before it by ``margin``, on a pair as on the
    rates: a tie keeps that mode.

    Where drafting ran at batch 1 greedy, the proposer also tells the gate what
    lookups alone would have done on the same tokens (:meth:`observe_shadow`,
    :mod:`duo_vllm.control.shadow`: the output is the same in every mode). Once drafting
    measured ``shadow_steps`` steps of a request, that is plain decoding's side
    of the verdict on it, in place of plain decoding's trial (due, or the pairing
    of a near lead) and of the rates of other requests: judged once a request,
    and again where plain decoding's trial falls due. A verdict against drafting
    is scoped to the request like a paired one.
    """

    def __init__(self, trial_steps: int = 32, warmup_steps: int = 8, retry_every: int = 256,
                 margin: float = 0.02, weight: float = 0.05, reach: int | None = 2,
                 paired_steps: int = 8, abandon_after: int = 4, judge_after: float = 0.25,
                 pair_within: float = 0.5, shadow_steps: int = 16):
        self.reach = reach  # buckets up that a win carries to a new bucket (None: any)
        self.abandon_after = abandon_after  # trial lengths of steps, of any batch size
        self.judge_after = judge_after  # the share of a trial a left trial is judged on
        self._steps = 0  # steps seen, all buckets
        self._trial_at: dict = {}  # bucket -> self._steps when its trial began
        self._abandoned_at: dict = {}  # bucket -> its step when its last trial was abandoned
        self.trial_steps, self.warmup_steps = trial_steps, warmup_steps
        self.retry_every, self.margin, self.weight = retry_every, margin, weight
        self._sums: dict = {}  # (bucket, on) -> [tokens, seconds], decayed
        self._rate: dict = {}  # (bucket, on) -> tokens/s: the ratio of those sums
        self._seen_at: dict = {}  # (bucket, on) -> the bucket's step of the last sample
        self._mode: dict = {}  # bucket -> drafting on?
        self._run: dict = {}  # bucket -> steps in the current mode
        self._clock: dict = {}  # bucket -> steps seen
        self._lost: dict = {}  # (bucket, mode) -> its retries in a row that lost
        self._trying: dict = {}  # bucket -> the mode under a retry's trial
        # bucket -> the mode under trial on a new request after a scoped verdict
        self._pairing: dict = {}
        self.paired_steps = paired_steps
        self.pair_within = pair_within  # drafting's lead on other requests' rates that is
        # taken as it is on a new request; a closer one is paired on that request
        self._paired: dict = {}  # bucket -> {(key, on): [tokens, seconds, steps]}
        self._scope: dict = {}  # bucket -> the request a verdict for plain decoding holds for
        self._wins: dict = {}  # bucket -> plain decoding's wins on requests in a row
        self._skip: dict = {}  # bucket -> requests still left to plain decoding after those
        self.shadow_steps = shadow_steps  # drafting's steps on a request a shadow verdict needs
        self._shadow: dict = {}  # bucket -> {key: [tokens, seconds, steps]} of lookups alone
        self._judged: dict = {}  # bucket -> the request its last shadow verdict was on
        self.plain_steps = 0  # steps the gate left to plain decoding
        self.log: deque = deque(maxlen=32)  # the last trials and verdicts, for stats

    def drafting(self, batch: int, sampled: bool = False, key=None) -> bool:
        """The mode for a step of ``batch`` requests (and the bookkeeping of the trials).

        ``sampled``: some request of the step samples (temperature > 0); ``key``: the
        request it serves, where the proposer pairs by request (batch 1).
        """
        b = self.bucket(batch, sampled)
        self._clock[b] = self._clock.get(b, 0) + 1
        self._steps += 1
        if b not in self._mode:
            self._mode[b] = self.first_mode(b)
        if self._next_request(b, key):
            if self._skip.get(b):  # a request left to plain decoding: its wins in a row
                self._skip[b] -= 1
                self._scope[b] = key
            else:
                self._try_again(b)
        if b in self._trying and self._steps - self._trial_at[b] > \
                self.abandon_after * (self.trial_steps + self.warmup_steps):
            self._abandon(b)
        on = self._mode[b]
        run = self._run[b] = self._run.get(b, 0) + 1
        if run > self.trial_steps + (self.warmup_steps if on else 0):
            other = (b, not on)
            if other in self._seen_at:  # measured (or judged on the shadow) at some step
                due = self._clock[b] - self._seen_at[other] > self._retry(b)
            else:  # never measured here: now, unless drafting is unlikely to pay here
                due = not (other[1] and not self.first_mode(b)) or self._clock[b] > self._retry(b)
            if due and b in self._abandoned_at and \
                    self._clock[b] - self._abandoned_at[b] <= self._retry(b):
                due = False  # a trial was abandoned here lately
            # a verdict (or a trial) falls due here: on the shadow where it can be had
            judge = due or self._judged.get(b) != key or b in self._trying
            if on and judge and self._shadow_ready(b, key):
                due = False  # plain decoding is judged on this request without a trial
                on = self._shadow_verdict(b, key)
            elif on and judge and self._shadow_pending(b, key):
                # drafting's trial ran into a new request: its own shadow judges it within
                # shadow_steps (a pairing or a verdict on the rates there once measured
                # the request before as well, and dropped this one's sums)
                due = False
            elif due:
                on = not on  # try the other mode (again), measured afresh
                self._start_trial(b, on)
            elif on and self._pairing.get(b) is True and self._best_pair(b) is None \
                    and not self._far_faster_on(b):
                on = self._pair(b)  # the same request in plain decoding, then a verdict
            elif b in self._trying:  # the end of a trial: judge; between trials, keep the mode
                on = self._verdict(b, key)
                if self._trying.pop(b) == self._mode[b]:
                    # the end of a retried mode's trial: did it lose (again)?
                    lost = (b, self._mode[b])
                    self._lost[lost] = self._lost.get(lost, 0) + 1 if on != self._mode[b] else 0
            if on != self._mode[b]:
                self._mode[b], self._run[b] = on, 0
                if due:
                    self._note(b, on, "trial")
        if not on:
            self.plain_steps += 1
        return on

    def _start_trial(self, b, on: bool) -> None:
        """Mode ``on`` goes on trial in bucket ``b``, measured afresh: its decayed sums
        and its per-request sums are dropped."""
        self._trying[b], self._trial_at[b] = on, self._steps
        self._sums.pop((b, on), None)
        paired = self._paired.get(b, {})
        for k in [k for k in paired if k[1] == on]:
            del paired[k]
        if on:  # the shadow covers drafting's measured steps: afresh with them
            self._shadow.pop(b, None)

    def _try_again(self, b) -> None:
        """A new request after a verdict for plain decoding scoped to the one before:
        drafting is on trial on this one (its warm-up, then a verdict on the rates)."""
        del self._scope[b]
        self._mode[b], self._run[b] = True, 0
        self._start_trial(b, True)
        self._pairing[b] = True
        self._note(b, True, "next request")

    def _pair(self, b) -> bool:
        """Drafting's trial on a new request ended slower than plain decoding on the
        requests before, with nothing to pair it with (plain decoding never ran on this
        request): plain decoding's trial follows on the same request, so the verdict
        compares the two modes on one request, not drafting on this one against plain
        decoding on an easier one (a request copied at 71 tok/s against a hard one
        drafted at 26 once kept drafting off for hundreds of steps). Where plain decoding
        wins that, it has won on two requests in a row: the next request is left to it
        too (see the class docstring)."""
        self._pairing[b] = False
        self._start_trial(b, False)
        self._note(b, False, "pairing", self._rate.get((b, True)), self._rate.get((b, False)))
        return False

    def _abandon(self, b) -> None:
        """The traffic left bucket ``b`` during its trial: judged on the rates where the
        trial measured enough steps (``judge_after``), else back to the mode before it."""
        tried = self._trying[b]
        measured = self._run.get(b, 0) - (self.warmup_steps if tried else 0)
        self._paired.pop(b, None)  # the trial's requests are gone: its rates, if anything
        self._shadow.pop(b, None)
        if (b, tried) in self._rate and measured >= self.judge_after * self.trial_steps:
            on = self._verdict(b)  # (it reads the mode on trial: popped after)
        else:
            on = not tried
            self._pairing.pop(b, None)
            self._note(b, on, "abandoned")
        del self._trying[b]
        self._mode[b], self._run[b] = on, 0
        self._abandoned_at[b] = self._clock[b]

    def trying(self, batch: int, sampled: bool = False) -> bool:
        """Is a retried mode on trial at this batch size (its steps are measured as that
        mode's, so nothing else should change meanwhile)?"""
        return self.bucket(batch, sampled) in self._trying

    def mode(self, batch: int, sampled: bool = False, key=None) -> bool:
        """The mode a step of ``batch`` requests (of request ``key``) would get now (no
        bookkeeping; a trial that falls due at that step aside)."""
        b = self.bucket(batch, sampled)
        if self._next_request(b, key) and not self._skip.get(b):
            return True  # a new request after a verdict scoped to the last one
        return self._mode[b] if b in self._mode else self.first_mode(b)

    def first_mode(self, b) -> bool:
        """A new bucket's first mode: the verdict of the nearest smaller batch size judged
        in both modes, in the same regime or, for sampled steps, a greedy one (drafting
        pays less as the batch grows, and under sampling). Where none is, drafting as if
        it had won at batch 1: so within ``reach`` buckets of it, and plain decoding
        above (a server whose first traffic is a burst of 16 requests once drafted them
        all on the target's own core, the draft prefilling 16 prompts: 0.76x plain vLLM)."""
        size, sampled = b
        judged = [(s, r == sampled) for (s, r), _ in self._rate
                  if s <= size and (r == sampled or sampled) and
                  ((s, r), True) in self._rate and ((s, r), False) in self._rate]
        if not judged:
            return self.reach is None or size <= self.reach
        s, same = max(judged)  # the nearest size; the same regime first
        near = (s, sampled if same else False)
        if self.reach is not None and size - s > self.reach:
            return False  # a win at batch 1 says little of batch 16: plain decoding first
        return self._rate[(near, True)] > self._rate[(near, False)]

    def _retry(self, b) -> int:
        """Steps before the slower mode is tried again: 4x as many when it was far slower
        and lost its last two trials (one trial may have been a cold start)."""
        r_on, r_off = self._rate.get((b, True)), self._rate.get((b, False))
        retried = not self._mode.get(b, True)
        if self._lost.get((b, retried), 0) >= 2 and r_on and r_off and \
                not close(r_on, r_off, 0.2):
            return 4 * self.retry_every
        return self.retry_every

    def _verdict(self, b, current=None) -> bool:
        """The end of a trial: the faster mode on the request both modes ran on longest,
        where there is one (paired), else over the modes' recent steps (``current``: the
        request of this step, where keyed)."""
        # drafting's trial on a new request after a verdict for plain decoding scoped to
        # the one before (not paired: it was not slower than plain decoding's rates)
        fresh = self._pairing.pop(b, None) is True
        key = self._best_pair(b)
        paired = self._paired.pop(b, {})
        self._shadow.pop(b, None)  # it shadows drafting's per-request sums: dropped with them
        if key is None:
            how = "rates"
            rates = self._rate.get((b, True)), self._rate.get((b, False))
            # no request ran both modes long enough to pair (plain decoding's trial ran
            # across a request boundary, say): a win on rates measured partly on other
            # requests holds for the current one
            key = current
        else:
            how, rates = "paired", tuple(paired[(key, m)][0] / paired[(key, m)][1]
                                         for m in (True, False))
        # a tie is no evidence: the mode from before the trial (not the one on trial)
        # stays; on a new request after a scoped verdict that is drafting (the verdict
        # was the last request's), as it was when the trial skipped its pairing
        # (faster_on: a tie). Else a tie there turned drafting off, unscoped, for a retry
        # interval: 256 batch-1 steps of requests that drafted at twice the speed.
        on = drafting_wins(*rates, self.margin, tie_on=fresh or not self._mode[b])
        if on or (self._trying.get(b) is False and key is not None):
            self._settle(b, on, key)  # (plain decoding won its own trial, on a request)
        self._note(b, on, how, *rates)
        return on

    def _settle(self, b, on: bool, key) -> None:
        """A verdict on request ``key``: for drafting, no new trial at the next request;
        for plain decoding, this request and as many after it as its wins in a row earn."""
        if on:
            self._scope.pop(b, None)
            self._wins.pop(b, None)
            self._skip.pop(b, None)
        else:
            wins = self._wins[b] = self._wins.get(b, 0) + 1
            self._scope[b] = key
            self._skip[b] = 2 ** (wins - 1) - 1

    def _best_pair(self, b):
        """The request both modes ran on longest in bucket ``b``, if both ran at least
        ``paired_steps`` steps on it (else None)."""
        paired = self._paired.get(b, {})
        both = [(min(paired[(k, True)][2], paired[(k, False)][2]), i, k)
                for i, (k, on) in enumerate(paired) if on and (k, False) in paired]
        best = max(both, default=None)
        return None if best is None or best[0] < self.paired_steps else best[2]

    def _shadow_ready(self, b, key) -> bool:
        """Did drafting, and lookups alone in its shadow, measure ``shadow_steps`` steps
        of request ``key`` in bucket ``b``?"""
        shadow = self._shadow.get(b, {}).get(key)
        on = self._paired.get(b, {}).get((key, True))
        return key is not None and shadow is not None and on is not None and \
            min(shadow[2], on[2]) >= self.shadow_steps and shadow[1] > 0 and on[1] > 0

    def _shadow_pending(self, b, key) -> bool:
        """Is request ``key``'s shadow under way in bucket ``b``, with fewer than
        ``shadow_steps`` steps of drafting measured on it yet?"""
        on = self._paired.get(b, {}).get((key, True))
        return key is not None and key in self._shadow.get(b, {}) and \
            (on is None or on[2] < self.shadow_steps)

    def _shadow_verdict(self, b, key) -> bool:
        """Drafting's rate on request ``key`` against lookups alone on the same tokens
        (:meth:`observe_shadow`): the faster, a tie to drafting (the mode under way).
        Plain decoding counts as measured now (its retry waits a retry interval); a
        verdict against drafting is scoped to this request, as a paired one."""
        on_sums, shadow = self._paired[b][(key, True)], self._shadow[b][key]
        rates = on_sums[0] / on_sums[1], shadow[0] / shadow[1]
        on = drafting_wins(*rates, self.margin, tie_on=True)
        self._judged[b] = key
        self._seen_at[(b, False)] = self._clock[b]
        self._pairing.pop(b, None)
        if self._trying.pop(b, None) is True:  # drafting's retry: did it lose (again)?
            lost = (b, True)
            self._lost[lost] = 0 if on else self._lost.get(lost, 0) + 1
        self._settle(b, on, key)  # as a paired verdict
        self._note(b, on, "shadow", *rates)
        return on

    def observe_shadow(self, batch: int, key, tokens: int, seconds: float,
                       sampled: bool = False) -> None:
        """Lookups alone would have produced ``tokens`` in ``seconds`` on the tokens a
        drafting step of request ``key`` produced (only steps :meth:`observe` counted).
        A step counts as one of drafting's, whatever the walk did in it (none of its steps
        ends inside a drafting step that a long copy spans)."""
        if key is None:
            return
        shadows = self._shadow.setdefault(self.bucket(batch, sampled), {})
        for other in [k for k in shadows if k != key]:  # only the request under way
            del shadows[other]
        _add_step(shadows.setdefault(key, [0.0, 0.0, 0]), tokens, seconds)

    def _far_faster_on(self, b) -> bool:
        """Did drafting's trial on a new request beat plain decoding's rates, measured on
        the requests before it, by more than ``pair_within``? Closer, a rate from other
        requests says little (lookups alone ran 20-48 tokens/s over four summaries at
        batch 1): plain decoding's own trial on this request decides. Judged on the
        rates, summaries drafted at 27 tokens/s against lookups' 22 on the request
        before kept drafting, where lookups alone ran them at 33."""
        return drafting_wins(self._rate.get((b, True)), self._rate.get((b, False)),
                             self.pair_within, tie_on=False)

    def faster_on(self, b) -> bool:
        """Do the recent rates favour drafting (a tie keeps the current mode)?"""
        return drafting_wins(self._rate.get((b, True)), self._rate.get((b, False)),
                             self.margin, tie_on=self._mode[b])

    def observe(self, batch: int, on: bool, tokens: int, seconds: float,
                sampled: bool = False, key=None) -> bool:
        """A step of ``batch`` requests in mode ``on`` produced ``tokens`` in ``seconds``
        (``key``: the request it served, where the proposer pairs by request). Whether it
        was counted (not a drafting warm-up step)."""
        if seconds <= 0:
            return False
        b = self.bucket(batch, sampled)
        if on and self._mode.get(b) and self._run.get(b, 0) <= self.warmup_steps:
            return False  # the draft is catching up: not yet what drafting gives
        tokens = self._per_request(b, batch, tokens)
        if key is not None:
            paired = self._paired.setdefault(b, {})
            if (key, on) not in paired and len(paired) >= 8:  # keep the last few requests'
                paired.pop(next((k for k in paired if k[0] != key), next(iter(paired))))
            _add_step(paired.setdefault((key, on), [0.0, 0.0, 0]), tokens, seconds)
        self._record(b, on, tokens, seconds)
        self._seen_at[(b, on)] = self._clock.get(b, 0)
        return True


@dataclass
class _Trial:
    """A lookup trial under way: the steps it has chosen so far and, per mode (lookups
    on?), the tokens, seconds and steps measured in it."""

    steps: int = 0
    sums: dict = field(default_factory=lambda: {True: [0.0, 0.0, 0], False: [0.0, 0.0, 0]})

    def next_mode(self) -> bool:
        """Lookups first, then plain decoding, by turns."""
        self.steps += 1
        return self.steps % 2 == 1

    def add(self, on: bool, tokens: float, seconds: float) -> None:
        _add_step(self.sums[bool(on)], tokens, seconds)

    def measured(self, min_samples: int) -> bool:
        return all(steps >= min_samples for _, _, steps in self.sums.values())

    def rate(self, on: bool) -> float | None:
        tokens, seconds, _ = self.sums[on]
        return tokens_per_s(tokens, seconds)


class LookupGate(_GateRates):
    """With the draft model off: lookup drafts, or none at all (plain decoding)?

    Verifying a copied token costs the target a slice of a step, and that
    slice grows with the batch: on a CPU target a lookup token that pays at
    batch 4 can lose at batch 16. Per bucket of :meth:`bucket`, the
    two modes' realised tokens per second decide, as for the model gate
    (:class:`_GateRates`).

    Neither mode has a draft to warm up, so a trial **interleaves** them, step
    by step (lookups, plain, lookups, ...), for ``2 · trial_steps`` steps of
    its bucket, and judges on the trial's own sums: both modes measured over
    the same stretch of the same requests. A trial of one mode after the other
    compared different stretches: at batch 4 sampled, lookups won 124.9 to
    107.2 tokens/s on a batch's first 17 steps (answers open by restating the
    prompt) against plain decoding on the next 17, then ran at 104 against
    plain decoding's 107 for the rest of the batch. A trial the traffic leaves
    (batch 16 drains in a few dozen steps) goes on when its bucket comes back;
    each mode needs ``min_samples`` measured steps before a verdict. The winner,
    by ``margin`` (a tie keeps the mode before), holds for ``retry_every``
    steps of the bucket, then the next trial; a verdict within ``2·margin``
    (weak evidence: 84.0 against 82.7 tokens/s on a batch's first 32 steps at
    batch 4 sampled, after which lookups ran at 73 against plain decoding's 84
    for the rest of the run) holds a quarter as long. A new bucket starts with a trial:
    a verdict for plain decoding at a smaller batch says nothing of a larger
    one's quotes, and a lookup trial costs no draft work.

    At batch 1 (steps that carry a ``key``: the request) a verdict for plain
    decoding holds for the request it fell on only, as the model gate's does:
    the next request starts with lookups again. Requests differ far more than
    the two modes do on any one of them: where copies are rarely accepted
    plain decoding won trials by 4-5% (23.6 against 24.7 tokens/s), where they
    are, lookups ran 2-3x plain decoding; a verdict on a short translation
    once held lookups off for the next requests, summaries among them, and the
    model gate's trials of "off" then measured plain decoding, not copies.
    """

    labels = ("lookup", "plain")  # the two modes' names in :meth:`rates`

    def __init__(self, trial_steps: int = 16, retry_every: int = 256, margin: float = 0.02,
                 weight: float = 0.05, min_samples: int = 4):
        self.trial_steps, self.retry_every, self.margin = trial_steps, retry_every, margin
        self.weight, self.min_samples = weight, min_samples
        self._mode: dict = {}  # bucket -> lookups on?
        self._clock: dict = {}  # bucket -> steps seen
        self._retry_at: dict = {}  # bucket -> its step past which the last verdict ends
        self._trial: dict = {}  # bucket -> its trial under way (:class:`_Trial`)
        self._sums: dict = {}  # (bucket, on) -> [tokens, seconds], decayed (stats)
        self._rate: dict = {}  # (bucket, on) -> tokens/s: the ratio of those sums
        self.plain_steps = 0  # steps the gate left to plain decoding
        self.log: deque = deque(maxlen=32)  # the last trials and verdicts, for stats
        self._scope: dict = {}  # bucket -> the request a verdict for plain decoding holds for

    def drafting(self, batch: int, sampled: bool = False, key=None) -> bool:
        """The mode for a step of ``batch`` requests (and the bookkeeping of the trials;
        ``key``: the request, at batch 1; a trial pairs by itself)."""
        b = self.bucket(batch, sampled)
        clock = self._clock[b] = self._clock.get(b, 0) + 1
        self._end_scope(b, key)
        if b not in self._mode:
            self._mode[b] = True
            self._start_trial(b)
        elif b not in self._trial and clock > self._retry_at[b]:
            self._start_trial(b)
        on = self._mode[b]
        trial = self._trial.get(b)
        if trial is not None:
            if trial.steps >= 2 * self.trial_steps and trial.measured(self.min_samples):
                on = self._verdict(b, key)
            else:
                on = trial.next_mode()
        if not on:
            self.plain_steps += 1
        return on

    def _start_trial(self, b) -> None:
        self._trial[b] = _Trial()
        self._note(b, self._mode[b], "trial")

    def _verdict(self, b, key=None) -> bool:
        """The end of a trial: the faster mode over the trial's interleaved steps (``key``:
        the request of this step, at batch 1, which a verdict for plain decoding holds for)."""
        trial = self._trial.pop(b)
        rates = trial.rate(True), trial.rate(False)
        on = self._mode[b] = drafting_wins(*rates, self.margin, tie_on=self._mode[b])
        # a verdict this close is weak evidence: it holds a quarter as long
        self._retry_at[b] = self._clock[b] + (
            self.retry_every // 4 if close(*rates, 2 * self.margin) else self.retry_every)
        self._note(b, on, "interleaved", *rates)
        if on:
            self._scope.pop(b, None)
        elif key is not None:
            self._scope[b] = key
        return on

    def _end_scope(self, b, key) -> None:
        """A plain verdict's request is over (``key`` is another): lookups again, with no
        trial (the next comes at the retry interval as ever)."""
        if self._next_request(b, key) and b not in self._trial:
            del self._scope[b]
            self._mode[b] = True
            self._note(b, True, "next request")

    def trying(self, batch: int, sampled: bool = False) -> bool:
        """Is a trial under way at this batch size?"""
        return self.bucket(batch, sampled) in self._trial

    def mode(self, batch: int, sampled: bool = False, key=None) -> bool:
        """The mode a step of ``batch`` requests would get outside a trial (no trial
        bookkeeping; at batch 1 a plain verdict ends with its request, as in
        :meth:`drafting`)."""
        b = self.bucket(batch, sampled)
        self._end_scope(b, key)
        return self._mode.get(b, True)

    def observe(self, batch: int, on: bool, tokens: int, seconds: float,
                sampled: bool = False, key=None) -> None:
        """A step of ``batch`` requests in mode ``on`` produced ``tokens`` in ``seconds``."""
        if seconds <= 0:
            return
        b = self.bucket(batch, sampled)
        tokens = self._per_request(b, batch, tokens)
        if b in self._trial:
            self._trial[b].add(on, tokens, seconds)
        self._record(b, on, tokens, seconds)


def tokens_per_s(tokens: float, seconds: float) -> float | None:
    """A measured rate; None before any time was measured."""
    return tokens / seconds if seconds > 0 else None
