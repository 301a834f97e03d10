"""The step's message to the draft side: one :class:`StepRequest` per vLLM step.

The proposer builds it; it travels as one object through
:class:`~duo_vllm.runtime.client.ActorClient` (Ray, or the Unix socket of
:mod:`duo_vllm.runtime.channel`: it pickles) to
:class:`~duo_vllm.runtime.actor.DraftWorker` and on to
:meth:`duo_vllm.draft.drafter.DuoDrafter.propose`. The answer is a list of
drafts, or a :class:`~duo_vllm.runtime.delta.Drafts`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from duo_vllm.sources.lookup import Hint


@dataclass(frozen=True)
class StepRequest:
    """One vLLM step's rows (a row per request), as the draft side needs them.

    The per-row fields are as long as ``contexts``; ``None`` where the
    proposer has nothing to say (all greedy, no lookups, lengths unknown).
    """

    # each row's full context (int32 arrays or lists), or a Delta of them against the
    # last step's (the worker keeps the contexts: duo_vllm.runtime.delta)
    contexts: Any
    budgets: Sequence[int]  # most draft tokens per row
    step_s: float | None = None  # T₀(B): the target's plain step at this batch size
    temperatures: Sequence[float] | None = None  # each row's sampling temperature (0: greedy)
    per_token_s: float | None = None  # c: the target's cost per extra verified token
    hints: Sequence[Hint | None] | None = None  # the proposer's lookup drafts
    remaining: Sequence[int | None] | None = None  # tokens each row may still generate

    def select(self, rows: Sequence[int], contexts) -> StepRequest:
        """The request of ``rows`` only, with ``contexts`` (theirs) in place of the step's."""
        def pick(values):
            return None if values is None else [values[i] for i in rows]

        return dataclasses.replace(self, contexts=contexts, budgets=pick(self.budgets),
                                   temperatures=pick(self.temperatures), hints=pick(self.hints),
                                   remaining=pick(self.remaining))
