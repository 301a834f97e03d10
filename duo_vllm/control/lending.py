"""When lending the draft's cores to a CPU target pays (the lending itself:
:mod:`duo_vllm.host.lending`)."""

from __future__ import annotations

# Of the draft's prefill time, the share a request loses when the draft prefills after the
# target rather than beside it: it decodes without drafts meanwhile, at about half the
# drafting rate; the draft's cost a token is taken as the target's, which errs towards not
# lending. 1.0 counts the whole prefill as lost.
PREFILL_LOSS = 0.5


def lend_prefill(target_tokens: int, draft_tokens: int, drafting: int, full: int,
                 loss: float = PREFILL_LOSS) -> bool:
    """Should the target prefill new prompts on every core, the draft prefilling after,
    rather than the two side by side? Lending saves ``n·c·(1 - drafting/full)`` on every
    token (``n = target_tokens``, a CPU prefill scaling with its threads); the request then
    decodes without drafts while the draft prefills ``draft_tokens``, losing ``loss`` of it."""
    if target_tokens <= 0 or full <= drafting:
        return False
    return target_tokens * (1 - drafting / full) >= loss * draft_tokens


def remake_pays(prefill_tokens: int, per_token_s: float, drafting: int, full: int,
                remake_s: float) -> bool:
    """Remake the target's matmuls before a lent step that would reuse one made on fewer
    threads (:class:`~duo_vllm.host.lending.MatmulPrimitives`)? Always before a decode step
    (its row count recurs); before a prefill of ``n`` tokens (its row count runs once) where
    the time it saves, ``n·per_token_s·(1 - drafting/full)``, exceeds ``remake_s``."""
    if prefill_tokens <= 0:
        return True
    return prefill_tokens * per_token_s * (1 - drafting / full) > remake_s
