"""Measured, not modelled: which mode makes a batch size fastest?

The verdict checks the outcome of the goodput plans (:mod:`duo_vllm.control.goodput`) in
realised tokens per second and runs the fastest of three modes: ``MODEL`` (the draft model
drafts, lookups beside it), ``LOOKUP`` (the free sources only) and ``PLAIN`` (no drafts).
Per batch-size bucket (1, 2-3, 4-7, ...; sampled steps apart) a mode's rate is its tokens
over its seconds (sums decaying by ``1 - weight`` a step), a step's tokens counted per
request at the bucket's smallest batch size. The rules (named numbers of :class:`Verdict`):

1. A mode runs ``trial_steps`` steps before it is judged; the model's first
   ``warmup_steps`` after it turns on are not measured (the draft catches up).
2. Every ``retry_every`` steps of a bucket, the rival tried least recently is tried again
   (measured afresh); it must beat the mode that ran before by ``margin``. A verdict
   judges only the modes measured in its round, and the mode that ran before it. Each
   verdict that keeps the mode doubles the bucket's interval, up to ``retry_max``; a
   rival's win brings it back to ``retry_every`` (a trial of a losing mode is the
   verdict's own cost).
3. A new bucket starts in the winner of the nearest smaller bucket measured in every mode,
   within ``reach`` buckets; else in the model up to batch ``2 ** reach``, lookups above.
   It tries the other modes at once, the model only where it started in it.
4. At batch 1 a verdict against the model holds for its request only (requests differ more
   than modes do): the next request starts on a trial of the model, then of the mode before.
"""

from __future__ import annotations

from collections import deque

from duo_vllm.control.goodput import batch_bucket

MODEL, LOOKUP, PLAIN = "model", "lookup", "plain"


def wins(rival: float | None, incumbent: float | None, margin: float) -> bool:
    """Does a rival's measured rate beat the incumbent's by ``margin``? An unmeasured
    incumbent loses to any measured rival; an unmeasured rival never wins."""
    if rival is None:
        return False
    return incumbent is None or rival > incumbent * (1 + margin)


def capped(batch: int | None, max_batch: int | None) -> bool:
    """The user's cap (``max_batch``): above it a step is plain decoding, no verdict."""
    return max_batch is not None and (batch or 0) > max_batch


class Verdict:
    """The mode each step runs in, per batch-size bucket (module docstring)."""

    def __init__(self, modes=(MODEL, LOOKUP, PLAIN), trial_steps: int = 32,
                 warmup_steps: int = 8, retry_every: int = 256, retry_max: int = 2048,
                 margin: float = 0.02, weight: float = 0.05, reach: int = 2):
        self.modes = tuple(modes)
        self.trial_steps, self.warmup_steps = trial_steps, warmup_steps
        self.retry_every, self.retry_max = retry_every, max(retry_max, retry_every)
        self.margin, self.weight = margin, weight
        self.reach = reach
        self._mode: dict = {}  # bucket -> the mode running
        self._run: dict = {}  # bucket -> steps in that mode
        self._clock: dict = {}  # bucket -> steps seen
        self._retry_at: dict = {}  # bucket -> its step when the next round of trials is due
        self._interval: dict = {}  # bucket -> steps from a verdict to its next round
        # bucket -> (the mode before the round, modes still to try, its step when it began)
        self._round: dict = {}
        self._scope: dict = {}  # bucket -> the request a verdict against the model is for
        self._tried_at: dict = {}  # (bucket, mode) -> its step when the mode last began
        self._sums: dict = {}  # (bucket, mode) -> [tokens, seconds], decayed
        self.steps = {m: 0 for m in self.modes}  # steps run in each mode
        self.log: deque = deque(maxlen=32)  # the last trials and verdicts, for stats

    @staticmethod
    def bucket(batch: int, sampled: bool = False) -> tuple[int, bool]:
        return batch_bucket(batch), bool(sampled)

    def rate(self, b, mode: str) -> float | None:
        tokens, seconds = self._sums.get((b, mode), (0.0, 0.0))
        return tokens / seconds if seconds > 0 else None  # None: not measured

    def choose(self, batch: int, sampled: bool = False, key=None) -> str:
        """The mode of a step of ``batch`` requests (``key``: its request, at batch 1),
        with the trials' bookkeeping."""
        b = self.bucket(batch, sampled)
        self._clock[b] = self._clock.get(b, 0) + 1
        if b not in self._mode:
            self._start(b)
        elif self._scope.get(b, key) != key:  # rule 4: a new request, the model on trial
            del self._scope[b]
            # then the mode before, afresh: both judged on this request
            self._open_round(b, [self._mode[b]])
            self._switch(b, MODEL, "next request")
            self._run[b] = 0  # counted below
        run = self._run[b] = self._run[b] + 1
        due = run > self.trial_steps + (self.warmup_steps if self._mode[b] == MODEL else 0)
        if due and b in self._round:
            self._next_trial(b, key)
        elif due and self._clock[b] >= self._retry_at[b]:
            rival = min((m for m in self.modes if m != self._mode[b]),
                        key=lambda m: self._tried_at.get((b, m), -1))
            self._open_round(b, [rival])
            self._next_trial(b, key)
        mode = self._mode[b]
        self.steps[mode] += 1
        return mode

    def peek(self, batch: int, sampled: bool = False, key=None) -> str:
        """The mode a step of ``batch`` requests would get now (no bookkeeping; a trial
        that falls due at that step aside)."""
        b = self.bucket(batch, sampled)
        if b not in self._mode:
            return self._first(b)
        if self._scope.get(b, key) != key:
            return MODEL
        return self._mode[b]

    def observe(self, batch: int, mode: str, tokens: int, seconds: float,
                sampled: bool = False) -> bool:
        """A step of ``batch`` requests in ``mode`` produced ``tokens`` in ``seconds``.
        Whether it was counted (not a warm-up step of the model)."""
        b = self.bucket(batch, sampled)
        if seconds <= 0 or (mode == MODEL and self._mode.get(b) == MODEL
                            and self._run.get(b, 0) <= self.warmup_steps):
            return False
        per_request = tokens * (1 << b[0]) / batch
        sums = self._sums.setdefault((b, mode), [0.0, 0.0])
        sums[0] = (1 - self.weight) * sums[0] + per_request
        sums[1] = (1 - self.weight) * sums[1] + seconds
        return True

    def rates(self) -> dict[str, float]:
        return {f"{1 << s}{'s' if sampled else ''}+{mode}": sums[0] / sums[1]
                for ((s, sampled), mode), sums in sorted(self._sums.items()) if sums[1] > 0}

    def _first(self, b) -> str:
        """Rule 3: a new bucket's first mode."""
        size, sampled = b
        judged = [s for (s, r), m in self._sums if m == MODEL and r == sampled and s < size
                  and all(((s, r), x) in self._sums for x in self.modes)]
        if judged and size - max(judged) <= self.reach:
            near = (max(judged), sampled)
            return max(self.modes, key=lambda m: self.rate(near, m) or 0.0)
        if MODEL in self.modes and size <= self.reach:
            return MODEL
        return LOOKUP if LOOKUP in self.modes else self.modes[-1]

    def _start(self, b) -> None:
        self._mode[b], self._run[b] = self._first(b), 0
        self._tried_at[(b, self._mode[b])] = self._clock[b]
        self._retry_at[b] = self._interval[b] = self.retry_every
        # rule 3: the modes not measured here yet, at once; the model only where it started
        # (a burst of new requests drafted on one core loses to plain)
        others = [m for m in self.modes if m != self._mode[b] and (b, m) not in self._sums
                  and (m != MODEL or self._mode[b] == MODEL)]
        if others:
            self._open_round(b, others)
            self._note(b, self._mode[b], "first")

    def _open_round(self, b, todo: list) -> None:
        """A round of trials of ``todo``, judged against the mode running now."""
        self._round[b] = (self._mode[b], todo, self._clock[b])

    def _switch(self, b, mode: str, how: str) -> None:
        self._mode[b], self._run[b] = mode, 1  # the step under way is its first
        self._tried_at[(b, mode)] = self._clock[b]
        self._sums.pop((b, mode), None)  # measured afresh
        self._note(b, mode, how)

    def _next_trial(self, b, key) -> None:
        """The mode on trial has run its steps: the round's next mode, or its verdict."""
        before, todo, since = self._round[b]
        if todo:
            self._switch(b, todo.pop(0), "trial")
            return
        del self._round[b]
        best = before if (b, before) in self._sums else None
        # judged: the mode before the round and those it tried, not a rate measured long
        # ago under other conditions
        judged = [m for m in self.modes if self._tried_at.get((b, m), -1) >= since]
        for m in judged:
            if m != best and wins(self.rate(b, m), self.rate(b, best), self.margin):
                best = m
        best = best or before
        self._mode[b], self._run[b] = best, 1
        self._interval[b] = (min(2 * self._interval[b], self.retry_max) if best == before
                             else self.retry_every)
        self._retry_at[b] = self._clock[b] + self._interval[b]
        if best != MODEL and key is not None and MODEL in self.modes:
            self._scope[b] = key  # rule 4
        self._note(b, best, "verdict", *(self.rate(b, m) for m in self.modes))

    def _note(self, b, mode: str, how: str, *rates) -> None:
        """Log a trial or a verdict: (bucket's step, bucket, mode, how, the rates)."""
        size, sampled = b
        self.log.append((self._clock.get(b, 0), f"{1 << size}{'s' if sampled else ''}", mode,
                         how, *(None if r is None else round(r, 1) for r in rates)))
