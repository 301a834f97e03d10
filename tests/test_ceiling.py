"""The batch-1 ceiling replay (benchmarks/ceiling.py) on hand-built requests: no model."""

import pytest

from benchmarks.ceiling import replay, window_prompt

COSTS = dict(t1=0.060, tl=0.050, c=0.001, d=0.015, prefill_target=0.001, prefill_draft=0.003)


def test_a_window_holds_the_prompts_first_quarter_and_its_end():
    p = list(range(1000))
    w = window_prompt(p, 256)
    assert w == p[:64] + p[1000 - 192:]
    assert window_prompt(p[:100], 256) == p[:100]
    assert window_prompt(p, 0) == p


def test_a_draft_that_always_guesses_right_beats_lookups_alone_on_an_unquoted_answer():
    p, o = list(range(100, 140)), list(range(1000, 1064))  # nothing in o repeats p
    _, model = replay(p, o, o, ready_rule="oracle", **COSTS)
    plain, lookups = replay(p, o, o, ready_rule="lookups", **COSTS)
    assert lookups == pytest.approx(plain, rel=0.05)  # nothing to copy
    assert model < 0.6 * plain


def test_a_long_prompts_draft_prefill_costs_more_when_its_core_is_not_lent():
    p, o = list(range(100, 1100)), list(range(2000, 2064))
    wrong = [0] * len(o)  # the model never helps: the prefill is all its effect
    _, lent = replay(p, o, wrong, ready_rule="oracle", **COSTS)
    _, busy = replay(p, o, wrong, ready_rule="oracle", busy_prefill=True, **COSTS)
    _, windowed = replay(p, o, wrong, ready_rule="oracle", busy_prefill=True, window=256,
                         **COSTS)
    assert lent <= windowed < busy  # a 256-token window is ready before the target


def test_a_free_hedge_on_the_runner_up_recovers_the_steps_a_top_one_miss_loses():
    p, o = list(range(100, 140)), list(range(1000, 1128))
    guess = [t if i % 3 else -1 for i, t in enumerate(o)]  # top-1 misses every third token
    second = [{t} if i % 3 == 0 else {-2} for i, t in enumerate(o)]  # ... where the runner-up is it
    _, designed = replay(p, o, guess, ready_rule="designed", second=second, **COSTS)
    _, hedged = replay(p, o, guess, ready_rule="hedged", second=second, **COSTS)
    _, oracle = replay(p, o, guess, ready_rule="oracle", **COSTS)
    assert oracle <= hedged < designed
    wrong = [{-2}] * len(o)  # a runner-up that is never the target's: no hedge ever lands
    _, nothing = replay(p, o, guess, ready_rule="hedged", second=wrong, **COSTS)
    assert nothing == pytest.approx(designed)
