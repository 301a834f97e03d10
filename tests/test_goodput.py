"""The goodput controller, on hand-built cost tables."""

import pytest

from duo_vllm.control.goodput import (
    Acceptance, DraftTimeModel, StepTimeModel, TargetCost, catch_up_pays, expected_accepted,
    plan_predraft, plan_served, plan_sync, predraft_root, predraft_time, regime, token_alphas,
)


def per_call(ms_one: float, ms_more: float = 0.0):
    """D(w) = ms_one + ms_more · (w - 1) milliseconds."""
    return lambda w: 0.0 if w <= 0 else 1e-3 * (ms_one + ms_more * (w - 1))


def goodput(alphas, n, cost, wait=0.0):
    return (len(alphas) + sum(expected_accepted(a, x) for a, x in zip(alphas, n))) / (
        cost.step(sum(n)) + wait)


def test_expected_accepted():
    assert expected_accepted(0.5, 0) == 0
    assert expected_accepted(1.0, 3) == 3
    assert expected_accepted(0.5, 2) == pytest.approx(0.5 + 0.25)


def test_served_tokens_stop_where_verifying_costs_more_than_they_bring():
    cost = TargetCost(0.050, 0.005)  # a token verified costs a tenth of a step
    # at batch 1, α = 0.9: the 4th token gains 0.66 > 0.005 · rate (~0.1)
    assert plan_served([0.9], [4], cost) == [4]
    # a poor draft is not worth verifying: α = 0.05 < c · floor = 0.1
    assert plan_served([0.05], [4], cost) == [0]
    # verification as expensive as a whole step: nothing pays
    assert plan_served([0.9], [4], TargetCost(0.050, 0.050)) == [0]
    # never more than the pre-draft holds
    assert plan_served([0.99], [2], cost) == [2]


def test_served_plan_is_the_best_of_all_plans():
    cost = TargetCost(0.100, 0.006)
    alphas = [0.9, 0.5, 0.2, 0.7]
    got = plan_served(alphas, [3] * 4, cost)
    best = max(((a, b, c, d) for a in range(4) for b in range(4) for c in range(4)
                for d in range(4)), key=lambda n: goodput(alphas, n, cost))
    assert goodput(alphas, got, cost) == pytest.approx(goodput(alphas, best, cost))
    assert got[0] >= got[3] >= got[1] >= got[2]  # higher acceptance, more tokens


def test_higher_acceptance_gives_more_tokens():
    cost = TargetCost(0.050, 0.008)
    lengths = [plan_served([a], [8], cost)[0] for a in (0.2, 0.4, 0.6, 0.8, 0.95)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]


def test_a_wider_batch_shrinks_the_budget_smoothly():
    # T₀(B) grows slower than B (batching pays), so each token's share of a step
    # falls and verifying a draft token costs relatively more
    per_row = []
    for b in (1, 2, 4, 8, 16, 32):
        cost = TargetCost(0.045 + 0.005 * b, 0.004)
        per_row.append(sum(plan_served([0.8] * b, [6] * b, cost)) / b)
    assert per_row == sorted(per_row, reverse=True)
    assert per_row[0] > per_row[-1]
    assert all(a - b <= 2 for a, b in zip(per_row, per_row[1:]))  # no cliff


def test_sync_drafting_too_expensive_gives_zero():
    cost = TargetCost(0.050, 0.002)
    plan = plan_sync([0.9], [4], [1], cost, per_call(100.0), base_tokens=1, base_extra=0)
    assert plan.rows == () and plan.depth == 0
    # a cheap draft is worth waiting for
    plan = plan_sync([0.9], [4], [1], cost, per_call(2.0), base_tokens=1, base_extra=0)
    assert plan.rows == (0,) and plan.depth == 4


def test_sync_drafting_takes_the_likeliest_requests_and_counts_catch_up():
    cost = TargetCost(0.100, 0.003)
    d = per_call(10.0, 6.0)
    plan = plan_sync([0.3, 0.95, 0.9], [4] * 3, [1] * 3, cost, d, base_tokens=3, base_extra=0)
    assert set(plan.rows) <= {1, 2} and 1 in plan.rows
    # the same request with a long prompt still to evaluate: waiting for it does not pay
    plan = plan_sync([0.95], [4], [300], cost, d, base_tokens=1, base_extra=0)
    assert plan.depth == 0


def test_a_free_lookup_draft_makes_waiting_for_the_model_pay_less():
    # batch 1, a 45 ms step, 12 ms draft calls, α 0.88: on a miss, drafting 4 tokens
    # on the spot pays against nothing (the controller's usual choice)
    cost = TargetCost(0.045, 0.0015)
    d = per_call(12.0, 8.0)
    assert plan_sync([0.88], [4], [1], cost, d, base_tokens=1, base_extra=0).depth == 4
    # the request's context offers a 4-token copy it accepts at 0.85: that is served for
    # free, and waiting ~48 ms for the model's draft no longer pays
    fb = (expected_accepted(0.85, 4), 4)
    plan = plan_sync([0.88], [4], [1], cost, d, base_tokens=1 + fb[0], base_extra=4,
                     fallback=[fb])
    assert plan.rows == () and plan.depth == 0
    # a copy it rarely accepts changes little: the model is still worth the wait
    fb = (expected_accepted(0.2, 2), 2)
    plan = plan_sync([0.88], [4], [1], cost, d, base_tokens=1 + fb[0], base_extra=2,
                     fallback=[fb])
    assert plan.rows == (0,) and plan.depth == 4
    # two misses, cheaper draft calls: the one without a good copy is drafted, the
    # other served its copy
    fb = [(expected_accepted(0.9, 4), 4), (0.0, 0)]
    plan = plan_sync([0.88, 0.85], [4, 4], [1, 1], cost, per_call(4.0),
                     base_tokens=2 + fb[0][0], base_extra=4, fallback=fb)
    assert plan.rows == (1,)


def test_predraft_fits_the_target_step_and_favours_likely_hits():
    d = per_call(10.0, 5.0)
    depths = plan_predraft([0.9], [0.8], [8], [1], 0.050, d, min_gain=0.01)
    assert depths == [4]  # catch-up + 4 calls of 10 ms = 50 ms
    assert predraft_time(depths, [1], d) <= 0.050
    depths = plan_predraft([0.9, 0.9], [0.8, 0.1], [4, 4], [1, 1], 0.060, d, min_gain=0.01)
    assert depths[0] > depths[1]
    assert predraft_time(depths, [1, 1], d) <= 0.060
    # a pre-draft that would never be served is not drafted
    assert plan_predraft([0.9], [0.8], [4], [1], 1.0, d, min_gain=0.95) == [0]
    # no time at all: nothing
    assert plan_predraft([0.9], [0.8], [4], [1], 0.005, d, min_gain=0.0) == [0]


def test_step_time_model_recovers_a_linear_cost():
    m = StepTimeModel()
    assert m.cost(1) is None
    for i in range(40):
        for batch, t0 in ((1, 0.050), (4, 0.090)):
            extra = i % 5 * batch
            m.observe(batch, extra, t0 + 0.004 * extra)
    c1, c4 = m.cost(1), m.cost(4)
    assert c1.t0 == pytest.approx(0.050, rel=1e-6) and c1.per_token == pytest.approx(0.004)
    assert c4.t0 == pytest.approx(0.090, rel=1e-6)
    # an unseen batch size: the nearest one's, plus about a token per extra request
    assert 0.090 < m.cost(5).t0 < 0.1


def test_step_time_model_measures_the_slope_per_batch_bucket():
    """A verified token costs more in a wide batch (compute-bound) than at batch 1: each
    bucket's slope is its own, and a bucket that never saw e vary borrows the pooled one."""
    m = StepTimeModel()
    for i in range(40):
        m.observe(1, i % 5, 0.050 + 0.001 * (i % 5))
        m.observe(16, i % 3 * 4, 0.090 + 0.008 * (i % 3 * 4))
        m.observe(4, 0, 0.060)
    assert m.cost(1).per_token == pytest.approx(0.001)
    assert m.cost(16).per_token == pytest.approx(0.008)
    assert m.cost(16).t0 == pytest.approx(0.090, rel=1e-6)
    # batch 4 never verified a draft token: the slope pooled over every batch size
    assert 0.001 < m.cost(4).per_token < 0.008
    assert m.cost(4).per_token == pytest.approx(m.per_token())


def test_step_time_model_before_the_slope_is_known_uses_its_prior():
    m = StepTimeModel(prior_per_token=0.1)
    for _ in range(5):
        m.observe(1, 0, 0.050)
    c = m.cost(1)
    assert c.t0 == pytest.approx(0.050) and c.per_token == pytest.approx(0.005)


def test_a_slope_steeper_than_a_whole_step_gives_way_to_the_prior():
    """A few disturbed steps (a neighbour's burst during the deep drafts) give a slope
    steep enough to put the intercept below 0; T₀ near 0 would make every draft look
    worthless, and without drafts nothing would correct it. A verified token costs no
    more than a whole step (c ≤ T₀): past that the prior slope stands in."""
    m = StepTimeModel(prior_per_token=0.1)
    for _ in range(10):
        m.observe(1, 1, 0.030)
        m.observe(1, 4, 0.200)  # disturbed
    c = m.cost(1)
    mx, my = 2.5, 0.115  # about: forgetting weighs the later steps a little more
    assert c.t0 == pytest.approx(my / (1 + 0.1 * mx), rel=0.01)
    assert c.per_token == pytest.approx(0.1 * c.t0)
    # a bucket that never saw e vary borrows a steep slope from a wide batch: the same
    m = StepTimeModel(prior_per_token=0.1)
    for i in range(40):
        m.observe(1, 4, 0.040)
        m.observe(16, i % 3 * 16, 0.090 + 0.008 * (i % 3 * 16))
    assert m.cost(1).t0 == pytest.approx(0.040 / 1.4, rel=1e-6)
    assert m.cost(16).per_token == pytest.approx(0.008)  # a slope below T₀ is kept
    # an unseen narrow batch costs at least its share of the nearest wider one's step,
    # and a token in it no more than that
    m = StepTimeModel()
    for i in range(40):
        m.observe(4, i % 5 * 4, 0.040 + 0.009 * (i % 5 * 4))
    one = m.cost(1)
    assert one.t0 >= m.cost(4).t0 / 4 and one.per_token <= one.t0


def test_draft_time_model_interpolates_widths():
    d = DraftTimeModel(prior_s=0.015)
    assert d(2) == pytest.approx(0.030)  # prior, per token
    d.observe(1, 0.010)
    d.observe(4, 0.040)
    assert d(1) == pytest.approx(0.010) and d(4) == pytest.approx(0.040)
    assert d(2) == pytest.approx(0.020)
    assert d(8) == pytest.approx(0.080)  # beyond: scaled per token of the widest
    d.observe(100, 0.300)  # a prefill chunk, bucketed to 128
    assert d(128) == pytest.approx(0.300 * 128 / 100)


def test_narrow_widths_below_the_measured_ones_follow_the_line_through_the_narrowest():
    """Only prefill chunks measured (the first prompt's): a one-token call is estimated
    from a call's fixed cost plus per token, not as half of a 16-token chunk."""
    d = DraftTimeModel()
    d.observe(16, 0.045)
    assert d(1) == pytest.approx(0.0225)  # one width: half of it
    d.observe(64, 0.146)
    slope = (0.146 - 0.045) / 48
    assert d(1) == pytest.approx(0.045 - 15 * slope)  # 13.4 ms, against 11.2 measured
    assert d(8) == pytest.approx(0.045 - 8 * slope) and d(1) < d(8) < d(16)
    d = DraftTimeModel()  # a steep line would go below zero: per token of the narrowest
    d.observe(16, 0.016)
    d.observe(32, 0.160)
    assert d(2) == pytest.approx(0.002)


def test_a_slow_narrow_width_is_bounded_by_a_wider_one_measured_since():
    d = DraftTimeModel()
    d.observe(1, 0.170)  # the draft's cold first call
    d.observe(2, 0.040)
    assert d(1) == pytest.approx(0.040)  # no call of one token costs more than of two
    for _ in range(20):
        d.observe(2, 0.036)
    assert d(1) <= d(2) == pytest.approx(0.036, rel=0.05)
    d.observe(1, 0.020)  # narrower and cheaper: its own estimate, not bounded from below
    assert d(1) < 0.036 and d(2) == pytest.approx(0.036, rel=0.05)


def test_acceptance_per_request_and_regime():
    acc = Acceptance(prior_weight=4)
    assert regime(0.0) == "greedy" and regime(0.7) == "sampled"
    for _ in range(20):
        acc.observe("a", "greedy", 4, 4)  # always fully accepted
        acc.observe("b", "sampled", 0, 4)  # always rejected at once
    assert acc.alpha("a", "greedy") > 0.9
    assert acc.alpha("b", "sampled") < 0.2
    # a new request starts from its regime's acceptance
    assert acc.alpha("c", "greedy") > 0.8 and acc.alpha("c", "sampled") < 0.3
    acc.forget("a")
    assert acc.alpha("a", "greedy") == acc.alpha("c", "greedy")


def test_a_catch_up_pays_only_well_within_what_is_left_of_the_request():
    # 300 tokens at 10 ms: 3 s of draft before its first draft token
    assert not catch_up_pays(300, 0.010, 20, 0.15)  # 20 tokens to go: 3 s at most
    assert catch_up_pays(300, 0.010, 40, 0.15)  # 6 s at most: half of it is the catch-up
    assert not catch_up_pays(300, 0.010, 39, 0.15)
    assert catch_up_pays(300, 0.010, None, 0.15)  # unknown: caught up, as a long request
    assert not catch_up_pays(1, 0.010, 0, 0.15) and catch_up_pays(0, 0.010, 0, 0.15)


def test_the_pre_draft_is_rooted_where_the_next_step_likelier_starts():
    # a weak copied tail (α_l 0.4) after 2 tokens the model drafted: rooted where it parts
    n, p = predraft_root(5, 2, 0.9, 0.4)
    assert n == 2 and p == pytest.approx(0.81 * 0.6 / 0.9)
    # a strong one (α_l 0.95): after the whole draft, as the chance all of it is accepted
    n, p = predraft_root(5, 2, 0.9, 0.95)
    assert n == 5 and p == pytest.approx(0.81 * 0.95 ** 3)
    # a sampled request: after the whole draft, however weak the copy
    assert predraft_root(5, 2, 0.9, 0.4, greedy=False) == (5, pytest.approx(0.81 * 0.4 ** 3))
    # the model's own draft, nothing copied: its end
    assert predraft_root(3, 3, 0.8, 0.1) == (3, pytest.approx(0.512))
    # a sure model (α 0.99) and an unsure copy: the model's guess is capped by 1 - α_l
    assert predraft_root(1, 0, 0.99, 0.5)[1] * 0.99 == pytest.approx(0.5)


def test_per_token_alphas_of_a_copy():
    assert token_alphas(0.8, 3) == [0.8, 0.8, 0.8]
    assert token_alphas((0.5, 0.7, 0.9), 4) == [0.5, 0.7, 0.9, 0.9]  # the last carried on
    assert token_alphas((0.5, 0.7, 0.9), 2, start=1) == [0.7, 0.9]
    assert expected_accepted((0.5, 1.0), 3) == pytest.approx(0.5 + 0.5 + 0.5)
    assert expected_accepted((0.8,), 4) == pytest.approx(expected_accepted(0.8, 4))
    # the copy's tokens after the model's: p_end from its own α there
    assert predraft_root(4, 2, 0.9, (0.1, 0.2, 0.9, 0.9), greedy=False) == \
        (4, pytest.approx(0.81 * 0.81))
    assert predraft_root(4, 2, 0.9, (0.9, 0.9, 0.3, 0.3))[0] == 2  # a weak tail: where it parts
    # weak first copied token, strong at the parting token: its end (α[agree], not α[0])
    assert predraft_root(4, 2, 0.9, (0.1, 0.9, 0.9, 0.9))[0] == 4
