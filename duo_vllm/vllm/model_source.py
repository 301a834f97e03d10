"""The draft model as a source (:class:`duo_vllm.sources.base.DraftSource`): its drafts
come from the proposer's one call a step to the draft side, so it drafts nothing itself;
it keeps each request's acceptance of the model's drafts."""

from __future__ import annotations

from duo_vllm.control.goodput import Acceptance
from duo_vllm.control.verdict import MODEL
from duo_vllm.sources.base import Proposal


class ModelSource:
    name = MODEL

    def __init__(self):
        self.acceptance = Acceptance()

    def begin(self, key) -> None:
        pass

    def accept(self, key, reg: str, proposal: Proposal, accepted: int, judged: int) -> None:
        self.acceptance.observe(key, reg, accepted, judged)

    def end(self, key) -> None:
        self.acceptance.forget(key)

    def alpha(self, key, reg: str) -> float:
        return self.acceptance.alpha(key, reg)

    def summary(self) -> dict:
        return {"model_alpha_greedy": self.acceptance.regime_alpha("greedy")}
