"""The drafter's own rules around the plans of :mod:`duo_vllm.control.goodput`: when to
prefill, probe, wait and reuse. Each takes measured numbers and returns a decision that
the drafter (:mod:`duo_vllm.draft`) executes."""

from __future__ import annotations

from duo_vllm.control.goodput import PROBE_EVERY, TargetCost, expected_accepted
from duo_vllm.control.serving import Hint, alpha_of, serve

# priors, until the drafter has measured its own
PRIOR_STEP_S = 0.05  # T₀: the target's plain step
PRIOR_PREFILL_S = 0.006  # the draft's time per token of a long prefill
PRIOR_TOKEN_S = 0.02  # the draft's time per token of a narrow decode call
PRIOR_PER_TOKEN = 0.1  # c, as a share of T₀

CATCH_UP = 16  # a request further behind than this holds a new prompt
PREFILL_CHUNK = 64  # tokens per decode call when prefilling in the background
MIN_PREFILL_CHUNK = 16  # ... at least, when other requests' pre-drafts wait behind it
CHUNK_STEP_SHARE = 0.4  # of a target step, the most one chunk may take beside decoding requests
FLOOR_PREFETCH = 4  # after this many steps without drafts, new prompts are not prefilled
PROBE_CATCH_UP_STEPS = 4  # most target steps of prefill a probe may cost
MIN_RESTORE = 16  # fewest prefill tokens a prompt-cache restore must spare


def assumed_cost(step_s: float | None, per_token_s: float | None) -> TargetCost:
    """T(B, ·) as last measured by the proposer; before that, the priors (c a share of T₀)."""
    t0 = step_s or PRIOR_STEP_S
    return TargetCost(t0, per_token_s if per_token_s is not None else PRIOR_PER_TOKEN * t0)


# -- catching up with a context -------------------------------------------------------------

def prefill_in_background(new_tokens: int, rows: int, step_s: float, prefill_s: float,
                          k: int) -> bool:
    """A miss with more context to evaluate than its share of a target step holds (and more
    than k + 1) is prefilled in the background, undrafted this step: no stalled target."""
    fits = int(step_s / prefill_s / max(rows, 1))
    return new_tokens > max(k + 1, fits)


def needs_prefill(behind: int) -> bool:
    """A request more than CATCH_UP tokens behind holds a new prompt: prefilled in shared
    chunks before its tree grows, so no decode call outlasts a chunk."""
    return behind > CATCH_UP


def prefill_chunk(others_decoding: bool, step_s: float, prefill_s: float) -> int:
    """Prompt tokens per background decode call: PREFILL_CHUNK, or while other requests'
    pre-drafts wait, what fits in CHUNK_STEP_SHARE of a step (at least MIN_PREFILL_CHUNK)."""
    if not others_decoding:
        return PREFILL_CHUNK
    fits = int(CHUNK_STEP_SHARE * step_s / prefill_s)
    return max(MIN_PREFILL_CHUNK, min(PREFILL_CHUNK, fits))


def sync_catch_up(tokens: int, predrafts: bool) -> int:
    """The catch-up a draft on the spot is charged for: all of it where a background thread
    could have run it, else one token (a new prompt evaluated now pays off in later steps)."""
    return tokens if predrafts else 1


def predraft_catch_up(behind: int, background: bool) -> int:
    """The catch-up a pre-draft is planned with: a background row's prefill runs anyway,
    so its tree is planned as if caught up (1)."""
    return 1 if background else max(1, behind)


def prefills_prompts(floor_streak: int) -> bool:
    """New prompts are prefilled ahead of their first step unless the last FLOOR_PREFETCH
    steps in a row drafted nothing: drafting does not pay now, so no draft work either."""
    return floor_streak < FLOOR_PREFETCH


def floor_streak_after(streak: int, asked: bool, drafted: bool) -> int:
    """Steps in a row that drafted nothing: a step with a draft ends the streak, one that
    ``asked`` (served a hit or a miss) and got none adds to it, others leave it."""
    if drafted:
        return 0
    return streak + 1 if asked else streak


def prompt_depth(budget: int | None, k: int) -> int:
    """Depth of the pre-draft queued with a prompt prefilled ahead: the budget, else min(2, k)."""
    return budget if budget is not None else min(2, k)


# -- probes ---------------------------------------------------------------------------------

def probe_due(quiet_steps: int) -> bool:
    """A request PROBE_EVERY steps without a draft gets one token anyway: its acceptance
    may have risen since, and only a draft measures it."""
    return quiet_steps >= PROBE_EVERY


def probe_affordable(catch_up: int, prefill_s: float, step_s: float) -> bool:
    """A pre-draft probe is worth no prefill longer than PROBE_CATCH_UP_STEPS target steps:
    draft work and memory traffic that slows the target, for one probed token."""
    return catch_up * prefill_s <= PROBE_CATCH_UP_STEPS * step_s


# -- serving and pre-drafting ---------------------------------------------------------------

def lookup_fallback(hint: Hint | None) -> tuple[float, int]:
    """(expected accepted tokens, length) of what a row is served from its free
    sources alone, as the proposer's :func:`~duo_vllm.control.serving.serve` cuts it."""
    draft, source = serve([], False, hint)
    if not draft:
        return 0.0, 0
    return expected_accepted(alpha_of(hint, source), len(draft)), len(draft)


def predraft_deadline(returned_at: float, expected_step_s: float | None,
                      fixed_budget: bool) -> float | None:
    """When the pre-draft should be done: when vLLM is expected back with the next step
    (under the controller; none with a fixed budget, or before a step was planned)."""
    if fixed_budget or not expected_step_s:
        return None
    return returned_at + expected_step_s


def ends_at_root(root: int, remaining: int | None) -> bool:
    """Does a request with ``remaining`` tokens left to its ``max_tokens`` end in the step
    under way, where that step accepts ``root`` draft tokens and so emits ``root + 1``? A
    pre-draft from that root is then never used."""
    return remaining is not None and root + 1 >= remaining


def call_overruns(now: float, call_s: float, deadline: float | None) -> bool:
    """Is a decode call forecast at ``call_s`` not started? Where half of it would already
    end past the deadline, the next step waiting on it."""
    return deadline is not None and now + 0.5 * call_s > deadline


def step_patience(token_s: float, busy_left_s: float, step_s: float) -> float:
    """How long a step waits for the decode call under way: 1.5 draft tokens' time; for a
    longer call (a prefill chunk) ending within half a target step, its forecast end plus
    a quarter (a loaded node overruns forecasts); else none: the step goes undrafted."""
    patience = 1.5 * token_s
    if busy_left_s > patience:
        patience = 1.25 * busy_left_s + 0.002 if busy_left_s < 0.5 * step_s else 0.0
    return patience


# -- reuse of held sequences ----------------------------------------------------------------

def saves_work(view_len: int, match: int, fresh: int) -> bool:
    """Does a sequence holding ``match`` tokens of a context's ``view_len``-token view
    leave less to evaluate than a slot taken afresh (``fresh`` tokens, its window)?"""
    return view_len - match < fresh


def restore_pays(match: int, reuse: int, view_len: int, fresh: int) -> bool:
    """Restore a prompt-cache entry holding ``match`` tokens of a context into a slot holding
    ``reuse`` of it? Where it spares MIN_RESTORE prefill tokens (it copies MBs) and
    :func:`saves_work` over a fresh window (``fresh`` tokens; the entry's view: ``view_len``)."""
    return match - reuse >= MIN_RESTORE and saves_work(view_len, match, fresh)
