"""The verdict (duo_vllm/control/verdict.py): the fastest measured mode per batch size,
driven by hand-built rates (tokens per step at a fixed step time)."""

from duo_vllm.control.verdict import LOOKUP, MODEL, PLAIN, Verdict, capped, wins


def run(v: Verdict, batch: int, steps: int, rate: dict, key=None, sampled=False) -> list:
    """``steps`` steps of ``batch`` requests, each mode producing ``rate[mode]`` tokens a
    step in 0.1 s; the modes chosen."""
    chosen = []
    for _ in range(steps):
        mode = v.choose(batch, sampled, key)
        v.observe(batch, mode, rate[mode], 0.1, sampled)
        chosen.append(mode)
    return chosen


def test_wins_needs_a_margin_and_a_measurement():
    assert wins(10.3, 10.0, 0.02) and not wins(10.1, 10.0, 0.02)
    assert wins(1.0, None, 0.02) and not wins(None, 10.0, 0.02)


def test_a_new_small_bucket_tries_every_mode_then_runs_the_fastest():
    v = Verdict(trial_steps=4, warmup_steps=2, retry_every=1000)
    chosen = run(v, 1, 30, {MODEL: 3, LOOKUP: 2, PLAIN: 1})
    # the model first (its warm-up unmeasured), then lookups, then plain decoding, then
    # the verdict for the model
    assert chosen[:6] == [MODEL] * 6 and chosen[6:11] == [LOOKUP] * 4 + [PLAIN]
    assert chosen[14:] == [MODEL] * 16
    assert v.log[-1][2:4] == (MODEL, "verdict")


def test_a_mode_that_loses_everywhere_is_left_and_retried_each_interval():
    v = Verdict(trial_steps=4, warmup_steps=0, retry_every=40, retry_max=40)
    chosen = run(v, 4, 120, {MODEL: 1, LOOKUP: 3, PLAIN: 2})
    assert chosen[:4] == [MODEL] * 4  # batch 4 is within reach: the model first
    tail = chosen[12:]
    assert tail.count(LOOKUP) > 0.75 * len(tail)  # lookups run between retries
    # one rival a retry, the one tried least recently: the model, then plain decoding
    retries = [x[2] for x in v.log if x[3] == "trial"][2:]
    assert retries[:2] == [MODEL, PLAIN] and 0 < tail.count(MODEL) <= 2 * 4


def test_verdicts_that_keep_the_mode_space_the_retries_out_and_a_rival_s_win_resets_them():
    v = Verdict(trial_steps=4, warmup_steps=0, retry_every=40, retry_max=160)
    chosen = run(v, 4, 1200, {MODEL: 1, LOOKUP: 3, PLAIN: 2})  # lookups keep winning
    verdicts = [x[0] for x in v.log if x[3] == "verdict"]
    gaps = [b - a for a, b in zip(verdicts, verdicts[1:])]
    # each gap: the interval, then the 4 steps of the retry's trial; the first verdict
    # was a rival's win (lookups over the model the bucket started in), the rest kept it
    assert gaps[:4] == [40 + 4, 80 + 4, 160 + 4, 160 + 4]
    # steps on trial after the first round: a 4-step trial every 160 steps at most, not
    # one every 40 (the log keeps 32 entries, so it is counted from the modes run)
    on_trial = sum(m != LOOKUP for m in chosen[12:])
    assert 0 < on_trial <= 4 * (1200 // 160 + 2)
    run(v, 4, 600, {MODEL: 1, LOOKUP: 2, PLAIN: 3})  # plain decoding now fastest
    assert v.peek(4) == PLAIN
    won = min(x[0] for x in v.log if x[2] == PLAIN and x[3] == "verdict")
    later = [x[0] for x in v.log if x[3] == "verdict" and x[0] > won]
    assert later and later[0] - won == 40 + 4  # the interval back to retry_every


def test_a_large_new_bucket_starts_without_the_model_and_tries_it_only_at_a_retry():
    v = Verdict(trial_steps=4, warmup_steps=0, retry_every=100)
    chosen = run(v, 16, 60, {MODEL: 9, LOOKUP: 2, PLAIN: 3})
    assert MODEL not in chosen  # no trial of the draft model on a burst of 16 at once
    assert chosen[:4] == [LOOKUP] * 4 and chosen[-1] == PLAIN
    chosen = run(v, 16, 60, {MODEL: 9, LOOKUP: 2, PLAIN: 3})
    assert chosen[-1] == MODEL  # its retry found it faster


def test_a_smaller_bucket_s_winner_carries_within_reach():
    v = Verdict(trial_steps=4, warmup_steps=0, retry_every=1000)
    run(v, 1, 20, {MODEL: 1, LOOKUP: 3, PLAIN: 2})  # batch 1: lookups win
    assert v.peek(2) == LOOKUP  # batch 2-3 starts where batch 1 ended
    v.reach = 0
    assert v.peek(2) == LOOKUP  # beyond reach: not the model, lookups


def test_at_batch_1_a_verdict_against_the_model_holds_for_its_request_only():
    v = Verdict(trial_steps=4, warmup_steps=0, retry_every=1000)
    run(v, 1, 20, {MODEL: 1, LOOKUP: 3, PLAIN: 2}, key="a")
    assert v.peek(1, key="a") == LOOKUP and v.peek(1, key="b") == MODEL
    chosen = run(v, 1, 12, {MODEL: 5, LOOKUP: 3, PLAIN: 2}, key="b")
    assert chosen[0] == MODEL and chosen[-1] == MODEL  # b drafts, and keeps drafting


def test_at_batch_1_the_next_request_judges_the_model_against_the_mode_before_on_itself():
    """A request that copies its prompt (lookups at 9 tokens a step) must not keep the
    model off on the next one, where the model makes 5 and lookups 3."""
    v = Verdict(trial_steps=4, warmup_steps=0, retry_every=1000)
    run(v, 1, 20, {MODEL: 1, LOOKUP: 9, PLAIN: 2}, key="a")
    assert v.peek(1, key="a") == LOOKUP
    chosen = run(v, 1, 14, {MODEL: 5, LOOKUP: 3, PLAIN: 2}, key="b")
    assert chosen == [MODEL] * 4 + [LOOKUP] * 4 + [MODEL] * 6
    assert v.log[-1][2:4] == (MODEL, "verdict")


def test_sampled_steps_are_judged_apart_from_greedy_ones():
    v = Verdict(trial_steps=4, warmup_steps=0, retry_every=1000)
    run(v, 1, 20, {MODEL: 3, LOOKUP: 2, PLAIN: 1})
    run(v, 1, 20, {MODEL: 1, LOOKUP: 2, PLAIN: 3}, sampled=True)
    assert v.peek(1) == MODEL and v.peek(1, sampled=True) == PLAIN
    assert set(v.rates()) >= {"1+model", "1s+plain"}


def test_without_lookups_two_modes_and_a_step_count_per_mode():
    v = Verdict(modes=(MODEL, PLAIN), trial_steps=4, warmup_steps=0, retry_every=1000)
    chosen = run(v, 1, 20, {MODEL: 1, PLAIN: 2})
    assert LOOKUP not in chosen and chosen[-1] == PLAIN
    assert v.steps[MODEL] + v.steps[PLAIN] == 20


def test_the_model_s_warm_up_steps_are_not_measured():
    v = Verdict(trial_steps=4, warmup_steps=3)
    v.choose(1)
    assert not v.observe(1, MODEL, 1, 0.1)  # the draft is catching up
    assert v.observe(1, LOOKUP, 1, 0.1)


def test_the_cap_is_the_users_max_batch():
    assert capped(9, 8) and not capped(8, 8) and not capped(64, None)
    assert not capped(None, 8)  # a step of unknown size is not capped


def test_a_verdict_judges_only_the_modes_measured_in_its_round():
    """A rate measured long ago under other conditions never wins a verdict: at a retry,
    the mode before and the rival tried are judged; the third mode waits for its own
    trial."""
    v = Verdict(trial_steps=4, warmup_steps=0, retry_every=40)
    # batch 4 starts in the model, tries lookups and plain decoding: lookups win, plain
    # decoding a close second
    chosen = run(v, 4, 30, {MODEL: 1, LOOKUP: 3, PLAIN: 2.9})
    assert chosen[-1] == LOOKUP
    # then the work changes: lookups stop paying, plain decoding is slow, the model fast
    now = {MODEL: 2.5, LOOKUP: 1, PLAIN: 1}
    chosen = run(v, 4, 40, now)
    # the retry tried the model (the rival tried least recently) and ran it after; plain
    # decoding's old 2.9 did not win without a trial
    assert [x[2:4] for x in v.log][-2:] == [(MODEL, "trial"), (MODEL, "verdict")]
    assert chosen[-10:] == [MODEL] * 10
