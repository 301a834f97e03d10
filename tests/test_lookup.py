"""The lookup source: the n-gram matcher on hand-built contexts, scoring, source choice."""

import numpy as np
import pytest

from duo_vllm.control.serving import paying_length, serve
from tests.support.fakes import hint_of
from duo_vllm.control.verdict import LOOKUP, MODEL
from duo_vllm.sources.base import Proposal, Sources, score
from duo_vllm.sources.lookup import (LOOKUP_PRIOR, MATCH_CLASSES, ContextLookup, MatchAcceptance,
                                     find_continuation, find_match, match_class)
from duo_vllm.vllm.model_source import ModelSource


def ctx(*tokens):
    return np.array(tokens, dtype=np.int32)


def test_the_longest_earlier_match_gives_what_followed_it():
    # "1 2 3" occurs earlier followed by 9 9; "2 3" also occurs followed by 4
    c = ctx(1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 1, 2, 3)
    assert find_continuation(c, 2, 2, 4).tolist() == [9, 9]
    assert find_continuation(c, 8, 2, 4).tolist() == [9, 9, 7, 2, 3, 4, 5, 1]
    assert find_continuation(ctx(1, 2, 3, 4), 4, 2, 4).tolist() == []  # no repeat
    assert find_continuation(ctx(1, 2, 3, 1, 2), 0, 2, 4).tolist() == []  # no room
    assert find_continuation(ctx(1, 2, 3, 1, 2), 4, 3, 4).tolist() == []  # too short a match
    # a repetition goes on with its period
    assert find_continuation(ctx(7, 7, 7, 7), 5, 2, 4).tolist() == [7] * 5
    assert find_continuation(ctx(3, 1, 2, 1, 2, 1, 2), 5, 2, 8).tolist() == [1, 2, 1, 2, 1]
    # two equal matches: the most recent one's continuation
    assert find_continuation(ctx(1, 2, 5, 1, 2, 6, 1, 2), 1, 2, 4).tolist() == [6]
    # capped at max_n: "4 1 2 3" would match longer, the 2-gram "2 3" is taken at its latest
    assert find_continuation(ctx(4, 1, 2, 3, 8, 2, 3, 9, 4, 1, 2, 3), 1, 2, 2).tolist() == [9]
    assert find_continuation(ctx(4, 1, 2, 3, 8, 2, 3, 9, 4, 1, 2, 3), 1, 2, 4).tolist() == [8]


def test_the_matcher_agrees_with_a_brute_force_search():
    rng = np.random.default_rng(1)
    for _ in range(300):
        c = rng.integers(0, 4, rng.integers(2, 40)).astype(np.int32)
        want = []
        for n in range(6, 1, -1):  # longest first, then the latest occurrence
            ends = [e for e in range(n - 1, len(c) - 1)
                    if c[e - n + 1:e + 1].tolist() == c[len(c) - n:].tolist()]
            if ends:  # what followed, repeating with the match's period past the end
                e = ends[-1]
                want = [int(c[e + 1 + j % (len(c) - 1 - e)]) for j in range(3)]
                break
        assert find_continuation(c, 3, 2, 6).tolist() == want, c.tolist()


def test_the_matcher_finds_an_early_match_in_16k_tokens():
    # its cost at that length: python -m benchmarks.lookup_cost
    rng = np.random.default_rng(0)
    c = rng.integers(0, 50000, 16384).astype(np.int32)
    c[-6:] = c[100:106]
    out = find_continuation(c, 8, 2, 8)
    assert out.tolist() == c[106:114].tolist()


def test_a_draft_is_judged_as_far_as_the_target_produced():
    assert score([7, 8, 9], [7, 8, 11]) == (2, 3)  # rejected at the third
    assert score([7, 8, 9], [7, 8]) == (2, 2)  # the third never judged
    assert score([7], [7, 8, 11]) == (1, 1)
    assert score([5, 8], [7]) == (0, 1)


def choose(model, lookup, alpha_model, alpha_lookup, threshold):
    """A model draft and one lookup draft, folded as the proposer serves them."""
    return serve(model, False, hint_of(lookup, alpha_model, alpha_lookup, threshold))


def test_agreeing_sources_serve_the_longer_and_disagreeing_the_more_likely():
    def combine(model, lookup, a_model, a_lookup):  # no tail cut (threshold 0)
        return choose(model, lookup, a_model, a_lookup, 0.0)
    assert combine([1, 2], [1, 2, 3, 4], 0.9, 0.1) == ([1, 2, 3, 4], LOOKUP)
    assert combine([1, 2, 3], [1, 2], 0.1, 0.9) == ([1, 2, 3], MODEL)
    assert combine([1, 2], [1, 5, 6], 0.9, 0.5) == ([1, 2], MODEL)
    assert combine([1, 2], [1, 5, 6], 0.5, 0.9) == ([1, 5, 6], LOOKUP)
    assert combine([], [4], 0.9, 0.1) == ([4], LOOKUP)
    assert combine([3], [], 0.1, 0.9) == ([3], MODEL)
    # per-token α of the copy: compared where they part
    assert combine([1, 2], [1, 5, 6], 0.7, (0.5, 0.8, 0.9)) == ([1, 5, 6], LOOKUP)
    assert combine([1, 2], [1, 5, 6], 0.7, (0.8, 0.6, 0.9)) == ([1, 2], MODEL)


def sources(min_n=2, max_n=8):
    return Sources(ModelSource(), [ContextLookup(min_n, max_n)])


def proposals(lookup, model=(), match=0):
    return [Proposal(LOOKUP, list(lookup), 0.0, meta=match), Proposal(MODEL, list(model), 0.0)]


def test_each_source_is_scored_served_or_not_and_finished_requests_are_forgotten():
    src = sources()
    lk = src.by_name[LOOKUP]
    src.observe(["a"], [ctx(1)])
    src.remember("a", 5, 0.0, proposals([1, 2, 3, 5], [1, 4]), LOOKUP, [1, 2, 3])
    src.observe(["a"], [ctx(0, 0, 0, 0, 0, 1, 2, 9)])  # target: 1 2 accepted, then 9
    assert src.served[LOOKUP] == 3 and src.accepted[LOOKUP] == 2
    assert src.served[MODEL] == 0
    a_l, a_m = lk.alpha("a", "greedy"), src.model.alpha("a", "greedy")
    # match length 0: class 1 (prior 0.3) held tokens 1-2, both accepted; the
    # 3rd (class 2) was rejected; the 4th never judged
    assert a_l > 0.3 and lk.alpha("a", "greedy", 2) < 0.4
    assert a_m < 0.7  # prior 0.7, then 1 of 2 trials (4 rejected)
    src.observe(["b"], [ctx(1, 2)])  # "a" finished
    assert lk.alpha("a", "greedy") == pytest.approx(
        lk.acceptance.by_class[match_class(0)].regime_alpha("greedy"))


def test_the_match_length_comes_with_the_continuation():
    c = ctx(4, 1, 2, 3, 8, 2, 3, 9, 4, 1, 2, 3)
    tokens, n = find_match(c, 1, 2, 4)
    assert tokens.tolist() == [8] and n == 4  # "4 1 2 3" again
    assert find_match(c, 1, 2, 2)[1] == 2  # capped at max_n
    assert find_match(ctx(1, 2, 3, 4), 4, 2, 4)[1] == 0  # no match
    rows = sources(2, 4).propose(["a", "b"], [c, ctx(1, 2, 3, 4)], [1, 1], [0.0, 0.0])
    assert [(p.tokens, p.meta) for (p,) in rows] == [([8], 4), ([], 0)]


def test_lookup_acceptance_is_kept_per_match_length():
    src = sources(2, 8)
    lk = src.by_name[LOOKUP]
    greedy = lk.acceptance.regime_alpha("greedy")
    assert [greedy[c] for c in MATCH_CLASSES] == sorted(greedy.values())  # priors rise with n
    assert match_class(2) == 2 and match_class(5) == 4 and match_class(8) == 6
    long_before = lk.alpha("a", "greedy", 8)
    for i in range(30):  # short matches of request "a" are rejected at once, every time
        src.remember("a", 10 * i, 0.0, proposals([1, 2], match=2), LOOKUP, [1, 2])
        src.observe(["a"], [np.arange(10 * i + 1, dtype=np.int32) + 5])
    assert lk.alpha("a", "greedy", 2) < 0.1
    assert lk.alpha("a", "greedy", 3) < lk.alpha("a", "greedy", 8)
    assert lk.alpha("a", "greedy", 8) == pytest.approx(long_before)  # untouched
    # a long match served and accepted in full raises its own class only
    src.remember("a", 400, 0.0, proposals([7, 7, 7], match=6), LOOKUP, [7, 7, 7])
    src.observe(["a"], [np.concatenate([np.zeros(400, np.int32), ctx(7, 7, 7, 1)])])
    assert lk.alpha("a", "greedy", 6) > long_before
    assert lk.alpha("a", "greedy", 2) < 0.1


def test_a_copy_is_judged_token_by_token_as_its_match_grows():
    """Token t of a copy after an n-token match was tried after a match of n + t
    tokens: a class's α is each token's acceptance given the ones before it."""
    m = MatchAcceptance()
    m.observe("a", "greedy", 2, 2, 4)  # after "2": accepted at 2 and 3, rejected at 4
    trials = {c: a._requests.get("a") for c, a in m.by_class.items()}
    assert trials[2] == [1.0, 1.0] and trials[3] == [1.0, 1.0]
    assert trials[4] == [0.0, 1.0] and trials[6] is None  # the 4th token never judged
    m.observe("b", "greedy", 6, 3, 3)  # all accepted: three successes, no failure
    assert m.by_class[6]._requests["b"] == [3.0, 3.0]  # one observation a copy
    m.observe("b", "greedy", 6, 7, 8)  # 7 accepted then 1 rejected: 7 of 8, not biased
    assert m.by_class[6]._requests["b"] == [pytest.approx(0.9 * 3 + 7), pytest.approx(0.9 * 3 + 8)]
    assert MatchAcceptance().alphas("c", "greedy", 2, 3) == tuple(
        LOOKUP_PRIOR[c]["greedy"] for c in (2, 3, 4))  # before any trial: the priors


def test_a_lookup_tail_is_cut_where_its_tokens_stop_paying():
    # per-token α that rise as the match grows: 0.5, then 0.9s
    assert paying_length(1.0, (0.5, 0.9, 0.9, 0.9), 4, 0.3) == 4  # .5 .45 .405 .36
    assert paying_length(1.0, (0.5, 0.9), 8, 0.3) == 5  # the last α carried on: .328
    assert paying_length(1.0, (0.5, 0.5, 0.9), 2, 0.1, start=1) == 2  # from token 1: .5 .45
    assert choose([1, 2], [1, 2, 3, 4], 0.9, (0.3, 0.3, 0.95, 0.2), 0.5) == ([1, 2, 3], LOOKUP)
    assert paying_length(1.0, 0.5, 8, 0.1) == 3  # 0.5, 0.25, 0.125 > 0.1 > 0.0625
    assert paying_length(0.5, 0.5, 8, 0.1) == 2  # after a lead of 0.5
    assert paying_length(1.0, 0.9, 2, 0.1) == 2  # capped by the tail
    # the model's [1, 2] agrees: the tail 3 4 5 is worth 0.9² · 0.5ᵗ
    assert choose([1, 2], [1, 2, 3, 4, 5], 0.9, 0.5, 0.15) == ([1, 2, 3, 4], LOOKUP)
    assert choose([1, 2], [1, 2, 3], 0.9, 0.05, 0.1) == ([1, 2], MODEL)  # tail does not pay
    assert choose([], [3, 4, 5], 0.9, 0.5, 0.2) == ([3, 4], LOOKUP)
    assert choose([], [3, 4, 5], 0.9, 0.5, float("inf")) == ([], LOOKUP)
    # they part: a shorter lookup more likely accepted still wins, unless none of it pays
    assert choose([1, 2, 3], [1, 9], 0.2, 0.9, 0.1) == ([1, 9], LOOKUP)
    assert choose([1, 2, 3], [1, 9], 0.2, 0.9, 0.95) == ([1, 2, 3], MODEL)
