"""The draft model as a source (:class:`duo_vllm.sources.base.DraftSource`).

Its drafts come from the draft side in one call a step (the proposer's
``_draft``), their lengths planned by the controller: :meth:`ModelSource.proposal`
wraps a row's draft; ``draft`` is never asked of it. What it keeps is each
request's acceptance of the model's drafts.
"""

from __future__ import annotations

from duo_vllm.control.goodput import Acceptance
from duo_vllm.control.verdict import MODEL
from duo_vllm.sources.base import Proposal


class ModelSource:
    name = MODEL

    def __init__(self):
        self.acceptance = Acceptance()

    def proposal(self, key, tokens, reg: str, drawn: bool = False) -> Proposal:
        return Proposal(MODEL, list(tokens), self.alpha(key, reg), drawn)

    def begin(self, key) -> None:
        pass

    def draft(self, key, context, k: int, reg: str) -> Proposal:
        raise NotImplementedError("the model's drafts come from the draft side's call")

    def accept(self, key, reg: str, proposal: Proposal, accepted: int, judged: int) -> None:
        self.acceptance.observe(key, reg, accepted, judged)

    def end(self, key) -> None:
        self.acceptance.forget(key)

    def alpha(self, key, reg: str) -> float:
        return self.acceptance.alpha(key, reg)

    def summary(self) -> dict:
        return {"model_alpha_greedy": self.acceptance.regime_alpha("greedy")}
