"""Draft sources behind one interface, and the step's bookkeeping over them.

A source proposes each row a draft with the acceptance of its tokens
(:class:`Proposal`); :func:`duo_vllm.control.serving.serve` picks what a row is
served among the proposals, the draft model's first. Every proposal is scored
against the tokens the target then produced, served or not, so each request's
acceptance per source is measured (:class:`Sources`).

The draft model is a source too (:mod:`duo_vllm.vllm.model_source`), but its
drafts come from the actor in one call a step, planned by the controller; the
others are *free*: they cost no draft-model time, run in the verdict's lookup
mode too, and their tails are cut to what pays for its verification. A new
free source is one module with a :class:`DraftSource` class decorated with
:func:`register`, imported in :mod:`duo_vllm.sources` (see docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from duo_vllm.control.goodput import regime


@dataclass(frozen=True)
class Proposal:
    """A source's draft for one row."""

    source: str
    tokens: list
    alpha: float | tuple  # one α for every token, or one per token (the ones before accepted)
    drawn: bool = False  # drawn from the draft's q: served as it is (control/serving.py)
    meta: Any = None  # what the source's accept() needs of it (a lookup: its match length)


class DraftSource(Protocol):
    """What a draft source implements (llama.cpp's common_speculative begin/draft/accept)."""

    name: str

    def begin(self, key) -> None:
        """Request ``key`` joins the batch."""

    def draft(self, key, context, k: int, reg: str) -> Proposal:
        """Up to ``k`` tokens to follow ``context`` (numpy int32), with their α in
        regime ``reg`` (``"greedy"``/``"sampled"``)."""

    def accept(self, key, reg: str, proposal: Proposal, accepted: int, judged: int) -> None:
        """``accepted`` of the ``judged`` first tokens of ``proposal`` matched the target."""

    def end(self, key) -> None:
        """Request ``key`` left the batch: forget it."""

    def alpha(self, key, reg: str) -> float:
        """The source's acceptance for ``key`` (its mean over the regime when unknown)."""

    def summary(self) -> dict:
        """The source's own stats keys (metrics, benchmarks)."""


SOURCES: dict[str, type] = {}  # name -> class: the free sources, in registration order


def register(name: str):
    """Class decorator: a free source named ``name``. It is built as
    ``cls.from_config(config)`` (else ``cls()``), where ``cls.enabled(config)`` (if
    defined) allows."""
    def add(cls):
        cls.name = name
        SOURCES[name] = cls
        return cls
    return add


def free_sources(config) -> list[DraftSource]:
    """The registered free sources that ``config`` enables, built."""
    return [cls.from_config(config) if hasattr(cls, "from_config") else cls()
            for cls in SOURCES.values() if getattr(cls, "enabled", lambda c: True)(config)]


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if int(x) != int(y):
            break
        n += 1
    return n


def score(draft, produced) -> tuple[int, int]:
    """(accepted, judged) of ``draft`` against the tokens the target ``produced`` after it.

    The target produced its accepted draft tokens plus one of its own, so a
    draft is judged only as far as ``produced`` reaches: one that matches all of
    it had no rejection observed (censored), one that differs was rejected there.
    """
    judged = min(len(draft), len(produced))
    return min(common_prefix(draft, produced), judged), judged


@dataclass
class _Step:
    start: int  # context length when proposed
    reg: str
    proposals: dict  # source -> its Proposal (non-empty ones)
    served: str | None  # the source served, if any
    tokens: list  # the tokens served


@dataclass
class SourceStats:
    served: dict = field(default_factory=dict)  # source -> tokens served
    accepted: dict = field(default_factory=dict)  # source -> of those, accepted


class Sources:
    """The model and the free sources of a step: each request's acceptance per source
    (``begin``/``accept``/``end``), the free sources' proposals, what was served."""

    def __init__(self, model: DraftSource, free: list[DraftSource]):
        self.model, self.free = model, list(free)
        self.by_name = {s.name: s for s in [model, *self.free]}
        self.stats = SourceStats({n: 0 for n in self.by_name}, {n: 0 for n in self.by_name})
        self._last: dict = {}  # request key -> _Step
        self._keys: set = set()  # the requests of the last step

    def observe(self, keys, contexts) -> None:
        """Score the last step's proposals against what the target produced since."""
        last, self._last = self._last, {}
        keys = list(keys)
        for key in self._keys - set(keys):  # finished (or preempted): forget its numbers
            for s in self.by_name.values():
                s.end(key)
        for key in set(keys) - self._keys:
            for s in self.by_name.values():
                s.begin(key)
        self._keys = set(keys)
        for key, ctx in zip(keys, contexts):
            p = last.get(key)
            if p is None or len(ctx) <= p.start:
                continue
            produced = ctx[p.start:]
            for name, prop in p.proposals.items():
                self.by_name[name].accept(key, p.reg, prop, *score(prop.tokens, produced))
            if p.served is not None:
                self.stats.served[p.served] += len(p.tokens)
                self.stats.accepted[p.served] += score(p.tokens, produced)[0]

    def propose(self, keys, contexts, caps, temps) -> list[list[Proposal]]:
        """Each row's proposals of the free sources, in registration order."""
        return [[s.draft(key, ctx, k, regime(t)) for s in self.free]
                for key, ctx, k, t in zip(keys, contexts, caps, temps)]

    def remember(self, key, start: int, temperature: float, proposals, served: str | None,
                 tokens: list) -> None:
        """What each source proposed for ``key`` at context length ``start``, and which
        ``served`` source's ``tokens`` went to vLLM."""
        kept = {p.source: p for p in proposals if p.tokens}
        if kept:
            self._last[key] = _Step(start, regime(temperature), kept,
                                    served if tokens else None, tokens)

    def summary(self) -> dict:
        out = {}
        for name, s in self.by_name.items():
            out[f"{name}_tokens_served"] = self.stats.served[name]
            out[f"{name}_tokens_accepted"] = self.stats.accepted[name]
            out.update(s.summary())
        return out
