"""Lookups alone replayed on tokens drafting produced (duo_vllm/control/shadow.py), on hand-built
contexts."""

import numpy as np
import pytest

from duo_vllm.control.shadow import ShadowLookups, lookup_walk, walk_rate


def test_the_walk_accepts_what_matches_and_adds_the_targets_own_token():
    # "1 2" came before, followed by 3 4 5 9; here 3 4 5 then 6
    ctx = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 6, 7])
    steps, pos = lookup_walk(ctx, 8, 8, 2, 8, lambda n, match: n)
    # at 8: the copy 3 4 5 9 1 2 ... (8 tokens) matches 3 of them, the target says 6;
    # at 12: "5 6" never came before: no draft, the target's token alone
    assert steps == [(8, 3), (0, 0)] and pos == 13
    tokens, seconds = walk_rate(steps, t0=0.04, per_token=0.001, overhead=0.002)
    assert tokens == 5 and seconds == pytest.approx(0.042 + 0.008 + 0.042)


def test_the_walk_stops_before_a_step_the_context_cannot_tell_yet():
    ctx = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3, 4])
    # at 8 the copy's first two tokens match all that follows: accepted further? unknown
    assert lookup_walk(ctx, 8, 8, 2, 8, lambda n, match: n) == ([], 8)
    # one more token tells: 3 4 then 7 (the target's own)
    steps, pos = lookup_walk(np.append(ctx, 7), 8, 8, 2, 8, lambda n, match: n)
    assert steps == [(8, 2)] and pos == 11


def test_the_walk_serves_what_the_cut_leaves_and_records_the_match_it_follows():
    ctx = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 9, 8])
    seen = []

    def cut(n, match):
        seen.append((n, match))
        return 2  # the goodput rule pays for two tokens only

    steps, _ = lookup_walk(ctx, 8, 8, 2, 8, cut)
    assert seen[0] == (8, 2) and steps[0] == (2, 2)  # "1 2": a 2-token match
    assert lookup_walk(ctx, 8, 8, 2, 8, lambda n, match: 0)[0][0] == (0, 0)  # none pays


def test_shadow_walks_go_on_step_by_step_and_restart_after_a_gap():
    s = ShadowLookups(k=8, min_n=2, max_n=8)
    ctx = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    assert s.advance("a", ctx[:11], 8, lambda n, m: n) == []  # 3 4 5 so far: untold
    # the next stretch (from 11): the step that began at 8 ends in it
    assert s.advance("a", ctx[:13], 11, lambda n, m: n) == [(8, 3), (0, 0)]
    # steps not measured in between (13-14): afresh at the measured stretch, 15
    assert s.advance("a", ctx, 15, lambda n, m: n) == []
    s.keep(["b"])
    # forgotten: afresh at 11, where "4 5" is followed by 9 (the target: 6)
    assert s.advance("a", ctx[:13], 11, lambda n, m: n) == [(8, 0), (0, 0)]
