"""The step's message to the draft side: one picklable :class:`StepRequest` per vLLM step,
answered by a list of drafts or a :class:`~duo_vllm.runtime.delta.Drafts`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from duo_vllm.control.serving import Hint


@dataclass(frozen=True)
class StepRequest:
    """One vLLM step's rows (one per request); per-row fields are as long as ``contexts``,
    or ``None`` where the proposer has nothing to say."""

    # each row's full context, or a duo_vllm.runtime.delta.Delta of them
    contexts: Any
    budgets: Sequence[int]  # most draft tokens per row
    step_s: float | None = None  # T₀(B): the target's plain step at this batch size
    temperatures: Sequence[float] | None = None  # each row's sampling temperature (0: greedy)
    per_token_s: float | None = None  # c: the target's cost per extra verified token
    hints: Sequence[Hint | None] | None = None  # the free sources' proposals
    remaining: Sequence[int | None] | None = None  # tokens each row may still generate

    def select(self, rows: Sequence[int], contexts) -> StepRequest:
        """The request of ``rows`` only, with ``contexts`` (theirs) in place of the step's."""
        def pick(values):
            return None if values is None else [values[i] for i in rows]

        return dataclasses.replace(self, contexts=contexts, budgets=pick(self.budgets),
                                   temperatures=pick(self.temperatures), hints=pick(self.hints),
                                   remaining=pick(self.remaining))
