"""Draft sources behind one interface, and the step's bookkeeping over them.

Each proposes a row a draft (:class:`Proposal`), scored against what the target then
produced, served or not. Besides the draft model (:mod:`duo_vllm.vllm.model_source`)
they are *free*: a new one is a :class:`DraftSource` class decorated with :func:`register`.
"""

from __future__ import annotations

from dataclasses import dataclass
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
        """Up to ``k`` tokens to follow ``context`` (int32), with their α in regime ``reg``."""

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
    """Class decorator: a free source named ``name``, built as ``cls.from_config(config)``
    (else ``cls()``) where ``cls.enabled(config)`` (if defined) allows."""
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
    """Length of the longest common prefix of two token sequences."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if int(x) != int(y)),
                min(len(a), len(b)))


def score(draft, produced) -> tuple[int, int]:
    """(accepted, judged) of ``draft`` against the tokens the target ``produced`` after it."""
    judged = min(len(draft), len(produced))
    return min(common_prefix(draft, produced), judged), judged


@dataclass
class _Step:
    start: int  # context length when proposed
    reg: str
    proposals: dict  # source -> its Proposal (non-empty ones)
    served: str | None  # the source served, if any
    tokens: list  # the tokens served


class Sources:
    """The model and the free sources: their proposals, scores, and what was served."""

    def __init__(self, model: DraftSource, free: list[DraftSource]):
        self.model, self.free = model, list(free)
        self.by_name = {s.name: s for s in [model, *self.free]}
        self.served = {n: 0 for n in self.by_name}  # source -> tokens served
        self.accepted = {n: 0 for n in self.by_name}  # source -> of those, accepted
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
                self.served[p.served] += len(p.tokens)
                self.accepted[p.served] += score(p.tokens, produced)[0]

    def propose(self, keys, contexts, caps, temps) -> list[list[Proposal]]:
        """Each row's proposals of the free sources, in registration order."""
        return [[s.draft(key, ctx, k, regime(t)) for s in self.free]
                for key, ctx, k, t in zip(keys, contexts, caps, temps)]

    def remember(self, key, start: int, temperature: float, proposals, served: str | None,
                 tokens: list) -> None:
        """What each source proposed for ``key`` at context length ``start``; what was served."""
        kept = {p.source: p for p in proposals if p.tokens}
        if kept:
            self._last[key] = _Step(start, regime(temperature), kept,
                                    served if tokens else None, tokens)

    def summary(self) -> dict:
        out = {}
        for name, s in self.by_name.items():
            out[f"{name}_tokens_served"] = self.served[name]
            out[f"{name}_tokens_accepted"] = self.accepted[name]
            out.update(s.summary())
        return out
