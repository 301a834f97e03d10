"""The gates: measured tokens per second decide, on hand-driven step sequences."""

import pytest

from duo_vllm.control.gate import DraftGate


def run_gate(gate, batch, rate_on, rate_off, steps):
    """Drive the gate as the proposer does; return the modes it chose."""
    modes = []
    for _ in range(steps):
        on = gate.drafting(batch)
        modes.append(on)
        gate.observe(batch, on, tokens=batch, seconds=batch / (rate_on if on else rate_off))
    return modes


def test_gate_turns_drafting_off_where_plain_decoding_is_faster_and_retries_it():
    # (reach=None: drafting is tried first at any batch size where nothing is judged yet)
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100, reach=None)
    modes = run_gate(gate, 16, rate_on=90.0, rate_off=100.0, steps=400)
    assert modes[:12] == [True] * 12  # drafting is tried first (with its warm-up)
    tail = modes[50:]
    assert sum(tail) / len(tail) < 0.15  # mostly plain decoding ...
    assert any(tail)  # ... with drafting tried again now and then
    assert gate.plain_steps == modes.count(False)
    # a mode far slower (here 1.5x) is retried 4x less often, once it lost twice
    far = run_gate(DraftGate(trial_steps=10, warmup_steps=2, retry_every=100, reach=None),
                   16, rate_on=60.0, rate_off=100.0, steps=800)
    near = run_gate(DraftGate(trial_steps=10, warmup_steps=2, retry_every=100, reach=None),
                    16, rate_on=90.0, rate_off=100.0, steps=800)
    assert sum(far[:300]) == sum(near[:300])  # the first two retries come as often
    assert sum(far[350:]) < sum(near[350:])


def test_a_cold_first_trial_does_not_keep_drafting_off_for_long():
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100)
    # the first trial of drafting is cold (the draft prefills the first prompt): far slower
    modes = run_gate(gate, 1, rate_on=10.0, rate_off=25.0, steps=20)
    modes += run_gate(gate, 1, rate_on=40.0, rate_off=25.0, steps=300)  # then it pays
    assert sum(modes[-100:]) > 85


def test_gate_keeps_drafting_where_it_pays_and_batch_sizes_are_judged_apart():
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100)
    modes = run_gate(gate, 1, rate_on=40.0, rate_off=20.0, steps=400)
    assert sum(modes[50:]) / len(modes[50:]) > 0.85
    modes16 = run_gate(gate, 16, rate_on=80.0, rate_off=100.0, steps=200)
    assert sum(modes16[50:]) / len(modes16[50:]) < 0.2
    assert gate.drafting(1)  # batch 1 still drafts
    assert DraftGate.bucket(1) != DraftGate.bucket(2) == DraftGate.bucket(3) != DraftGate.bucket(4)
    assert DraftGate.bucket(1) != DraftGate.bucket(1, sampled=True)


def test_gate_judges_sampled_steps_apart_from_greedy_ones():
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100)
    modes = []
    for _ in range(300):  # greedy requests gain from drafts, sampled ones lose
        for sampled, rate_on in ((False, 40.0), (True, 15.0)):
            on = gate.drafting(1, sampled)
            modes.append((sampled, on))
            gate.observe(1, on, 1, 1 / (rate_on if on else 20.0), sampled)
    greedy = [on for s, on in modes[200:] if not s]
    sampled = [on for s, on in modes[200:] if s]
    assert sum(greedy) / len(greedy) > 0.85 and sum(sampled) / len(sampled) < 0.15


def test_gate_follows_a_change():
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=50)
    run_gate(gate, 4, rate_on=50.0, rate_off=100.0, steps=200)
    modes = run_gate(gate, 4, rate_on=200.0, rate_off=100.0, steps=300)  # drafting got better
    assert sum(modes[-100:]) / 100 > 0.7  # on, but for the trials of plain decoding


def test_the_longer_wait_counts_the_losses_of_the_mode_retried_only():
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100)
    run_gate(gate, 1, rate_on=40.0, rate_off=25.0, steps=150)  # plain decoding loses twice
    modes = run_gate(gate, 1, rate_on=10.0, rate_off=25.0, steps=1000)  # now drafting is slow
    # plain decoding lost twice and far: its next trial comes 4x later (a mode changes only
    # at the end of a trial); it wins, and drafting is retried from then on
    switch = modes.index(False)
    assert 300 < switch <= 400
    retries = [i - switch for i in range(switch, 1000) if modes[i] and not modes[i - 1]]
    # drafting's own first two losses are retried at the usual interval, then 4x later
    assert retries[:2] == [pytest.approx(100, abs=3), pytest.approx(213, abs=3)]
    assert len(retries) == 2


def test_a_new_batch_size_starts_in_the_mode_that_won_at_the_nearest_smaller_one():
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100)
    assert gate.drafting(2)  # nothing judged yet: drafting first, as batch 1's winner ...
    # ... so within reach of batch 1 only: a first burst of 16 requests starts plain (it
    # drafted on the target's own core at 0.76x plain vLLM), and waits a retry interval
    modes = run_gate(DraftGate(trial_steps=10, warmup_steps=2, retry_every=100), 16,
                     rate_on=150.0, rate_off=100.0, steps=160)
    assert modes[:100] == [False] * 100 and all(modes[-20:])
    lending = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100, reach=0)
    assert not lending.drafting(2) and lending.drafting(1) and lending.drafting(1, True)
    assert DraftGate(reach=None).drafting(16)
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100)
    run_gate(gate, 1, rate_on=40.0, rate_off=20.0, steps=60)  # batch 1: drafting pays
    run_gate(gate, 2, rate_on=20.0, rate_off=30.0, steps=60)  # batch 2-3: it does not
    assert not gate.drafting(4)  # 4-7 starts plain, as its nearest smaller judged size
    assert not gate.drafting(2, sampled=True)  # sampling pays no more than greedy
    assert gate.drafting(1, sampled=True)  # greedy batch 1 drafts: sampled batch 1 tries it
    # the mode it starts in is still judged, but drafting, which lost at a smaller size,
    # is tried as a retry would be (after retry_every steps), not at once: a server pays
    # no trial of drafting at each new batch size where it is unlikely to pay
    modes = run_gate(gate, 16, rate_on=90.0, rate_off=30.0, steps=160)
    assert modes[:100] == [False] * 100 and all(modes[-20:])
    assert gate.drafting(1)  # and a smaller size keeps its own verdict


def test_a_win_carries_to_a_batch_size_up_to_reach_buckets_above():
    # drafting won at batch 1: batch 4-7 (two buckets up) tries it at once ...
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100)
    run_gate(gate, 1, rate_on=40.0, rate_off=20.0, steps=60)
    modes = run_gate(gate, 4, rate_on=30.0, rate_off=40.0, steps=60)
    assert modes[:12] == [True] * 12 and not any(modes[-20:])
    # ... batch 16 (four up: a static batch right after batch-1 traffic) starts plain and
    # waits a retry interval for drafting's first trial; with reach=None the win carries
    for reach, first in ((2, False), (None, True)):
        gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100, reach=reach)
        run_gate(gate, 1, rate_on=40.0, rate_off=20.0, steps=60)
        modes = run_gate(gate, 16, rate_on=90.0, rate_off=100.0, steps=60)
        assert modes[0] is first and (any(modes) if first else not any(modes))
        if not first:  # the trial comes as a retry would, and is judged as one
            modes = run_gate(gate, 16, rate_on=150.0, rate_off=100.0, steps=100)
            assert not modes[0] and all(modes[-20:])
    # reach=0 (a lending target: plain decoding gets the draft's cores) carries no win up
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100, reach=0)
    run_gate(gate, 1, rate_on=40.0, rate_off=20.0, steps=60)
    assert not run_gate(gate, 2, rate_on=30.0, rate_off=40.0, steps=60)[0]
    assert gate.drafting(1, sampled=True)  # the same batch size, sampled: still carried


def test_a_dip_between_trials_does_not_switch_the_mode():
    """The steps while the draft prefills a new long prompt are slow with drafting on;
    such a dip must not turn drafting off for a whole retry interval."""
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100)
    run_gate(gate, 1, rate_on=60.0, rate_off=20.0, steps=60)  # judged: drafting pays
    before = gate.plain_steps  # the first trial of plain decoding
    modes = run_gate(gate, 1, rate_on=5.0, rate_off=20.0, steps=20)  # a cold stretch
    modes += run_gate(gate, 1, rate_on=60.0, rate_off=20.0, steps=40)
    assert all(modes)  # no trial of plain decoding was due: drafting throughout
    assert before > 0 and gate.plain_steps == before


def test_mode_peeks_without_counting_a_step():
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100)
    run_gate(gate, 1, rate_on=20.0, rate_off=40.0, steps=60)  # batch 1: plain decoding wins
    clock = dict(gate._clock)
    assert gate.mode(1) is False and gate.mode(2) is False  # 2-3 would start as 1 ended
    assert gate.mode(1, sampled=True) is False
    assert gate._clock == clock  # no step counted, no trial moved


def test_the_verdict_weighs_a_cold_stretch_by_what_it_cost():
    """Each request starts with steps where the draft is still prefilling (slow, one
    token) before drafting pays (four tokens). A trial of plain decoding that comes
    right after such a stretch must still find drafting faster overall."""
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100)
    off = 1 / 25.0  # plain decoding: 25 tokens/s
    modes = []
    for step in range(1200):
        on = gate.drafting(1)
        modes.append(on)
        cold = step % 30 < 14  # the first 14 steps of each 30-step request
        tokens, seconds = (1, 1 / 15.0) if cold else (4, 4 / 60.0)
        gate.observe(1, on, tokens if on else 1, seconds if on else off)
    # drafting averages 39 tokens/s, plain 25: the only plain steps are plain decoding's
    # trials (a first cold trial of drafting aside), each 11 steps, 100 or more apart
    plain = [i for i in range(200, 1200) if not modes[i] and modes[i - 1]]
    assert plain and all(modes[i:i + 11] == [False] * 11 and modes[i + 11] for i in plain)
    assert all(b - a >= 100 for a, b in zip(plain, plain[1:]))
    assert modes[200:].count(False) <= 5 * 11



def switches(modes):
    """The steps where the mode changed."""
    return [i for i in range(1, len(modes)) if modes[i] != modes[i - 1]]


def test_the_lookup_gate_serves_lookups_where_they_pay_and_plain_decoding_where_not():
    from duo_vllm.control.gate import LookupGate

    gate = LookupGate(trial_steps=10, retry_every=100)
    # batch 4: lookups pay; batch 16: verifying them costs more than they bring
    modes4 = run_gate(gate, 4, rate_on=60.0, rate_off=50.0, steps=300)
    modes16 = run_gate(gate, 16, rate_on=90.0, rate_off=100.0, steps=300)
    # a new bucket starts with a trial: the two modes by turns, lookups first
    assert modes16[:20] == [True, False] * 10
    assert sum(modes4[-200:]) >= 180  # lookups kept where they pay (plain tried by turns)
    assert sum(modes16[-200:]) < 30  # plain decoding where they lose, retried now and then
    assert any(modes16[-200:])
    assert gate.plain_steps == modes4.count(False) + modes16.count(False)
    assert set(gate.rates()) == {"4+lookup", "4+plain", "16+lookup", "16+plain"}


def test_the_lookup_gate_never_carries_plain_decoding_to_a_new_batch_size():
    from duo_vllm.control.gate import LookupGate

    gate = LookupGate(trial_steps=10, retry_every=100)
    run_gate(gate, 1, rate_on=20.0, rate_off=20.2, steps=200)  # a tie at batch 1 ...
    assert gate.mode(1)  # (a tie keeps the mode before: lookups)
    run_gate(gate, 1, rate_on=20.0, rate_off=25.0, steps=200)  # ... then plain decoding
    assert not gate.mode(1)
    # ... says nothing of batch 4, where the quotes pay
    modes = run_gate(gate, 4, rate_on=60.0, rate_off=50.0, steps=200)
    assert modes[:20] == [True, False] * 10
    assert sum(modes[-100:]) >= 90  # plain decoding tried by turns once in 100 steps
    # the draft-model gate does carry a loss upward (it costs draft work to try)
    model = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100)
    run_gate(model, 1, rate_on=20.0, rate_off=30.0, steps=200)
    assert not model.mode(4)


def test_the_lookup_gate_judges_both_modes_on_the_same_stretch_of_a_batch():
    """Batch 4 under sampling: the first steps of a batch copy well (answers restate
    the prompt), later ones do not. A trial of lookups on the batch's first steps, then
    plain decoding on the next, once kept lookups that lost for the rest of the batch.
    Interleaved, the trial sees both modes on both stretches."""
    from duo_vllm.control.gate import LookupGate

    def batch_rates(step):  # (lookups, plain) tokens/s at a batch's step
        return (140.0, 105.0) if step < 12 else (85.0, 105.0)

    gate, modes = LookupGate(trial_steps=16, retry_every=256), []
    for step in range(128):
        on = gate.drafting(4, sampled=True)
        modes.append(on)
        rate = batch_rates(step)[0 if on else 1]
        gate.observe(4, on, tokens=4, seconds=4 / rate, sampled=True)
    # the first 32 steps are the trial; plain decoding holds the batch's rest
    assert modes[:32] == [True, False] * 16
    assert not any(modes[33:])
    assert gate.log[-1][2:4] == ("plain", "interleaved")
    # the same batch, one mode after the other (the model gate's trials), keeps lookups
    sequential, modes = DraftGate(trial_steps=12, warmup_steps=0, retry_every=256), []
    for step in range(128):
        on = sequential.drafting(4, sampled=True)
        modes.append(on)
        rate = batch_rates(step)[0 if on else 1]
        sequential.observe(4, on, tokens=4, seconds=4 / rate, sampled=True)
    assert sum(modes[40:]) == len(modes[40:])


def test_a_lookup_trial_the_traffic_leaves_goes_on_when_its_bucket_comes_back():
    from duo_vllm.control.gate import LookupGate

    gate = LookupGate(trial_steps=10, retry_every=100)
    first = run_gate(gate, 16, rate_on=90.0, rate_off=100.0, steps=8)  # a burst drains
    run_gate(gate, 8, rate_on=90.0, rate_off=100.0, steps=30)
    assert gate.trying(16) and first == [True, False] * 4
    again = run_gate(gate, 16, rate_on=90.0, rate_off=100.0, steps=20)
    assert again[:12] == [True, False] * 6  # its 20 steps by turns, then the verdict
    assert not gate.trying(16) and not again[-1]


def test_modes_that_tie_are_not_swapped_more_than_once_a_retry_interval():
    gate = DraftGate(retry_every=256)
    modes = run_gate(gate, 4, rate_on=50.0, rate_off=50.0, steps=3000)
    # a tie keeps the mode before the trial: one trial (out and back) a retry interval
    assert len(switches(modes)) <= 2 * (3000 // 256 + 1)
    assert sum(modes) > 0.85 * len(modes)


def test_lookup_modes_that_tie_keep_lookups_outside_the_trials():
    from duo_vllm.control.gate import LookupGate

    gate = LookupGate(trial_steps=16, retry_every=256)
    modes = run_gate(gate, 4, rate_on=50.0, rate_off=50.0, steps=3000)
    trials = [entry for entry in gate.log if entry[3] == "interleaved"]
    # a trial's 2 x 16 interleaved steps, its verdict's step, then 64 steps held (a
    # quarter of the retry interval: a verdict this close is weak evidence)
    full_cycles, left = divmod(3000, 2 * 16 + 1 + 256 // 4)
    assert not gate.trying(4)
    assert all(entry[2] == "lookup" for entry in trials)  # a tie keeps the mode before
    # the trials' plain steps, no others
    assert modes.count(False) == 16 * (full_cycles + (left > 2 * 16))


def test_a_close_lookup_verdict_is_tried_again_sooner():
    """Batch 4 sampled: lookups barely win the trial on a batch's first steps (84.0
    against 82.7 tokens/s), then lose for the rest of it (73 against 84). A verdict that
    close holds a quarter of the retry interval; a clear one the whole of it."""
    from duo_vllm.control.gate import LookupGate

    def run(rates_at):
        gate, modes = LookupGate(trial_steps=16, retry_every=256), []
        for step in range(240):
            on = gate.drafting(4, sampled=True)
            modes.append(on)
            gate.observe(4, on, 4, 4 / rates_at(step)[0 if on else 1], sampled=True)
        return modes

    modes = run(lambda step: (84.0, 82.7) if step < 32 else (73.0, 84.0))
    assert all(modes[32:97]) and not any(modes[130:])  # the next trial at 97: plain
    clear = run(lambda step: (100.0, 82.7) if step < 32 else (73.0, 84.0))
    assert all(clear[32:240])  # held for the retry interval


def test_a_lookup_verdict_for_plain_decoding_at_batch_1_holds_for_its_request_only():
    """Batch 1: a request where copies are rarely accepted (plain decoding a little
    faster), then one that quotes its prompt (lookups 3x faster). The trial on the
    first says plain decoding; the second starts with lookups again, and the model
    gate's view of "off" (``mode``) follows it."""
    from duo_vllm.control.gate import LookupGate

    gate = LookupGate(trial_steps=16, retry_every=256)
    for _ in range(40):  # request "a": its trial, then plain decoding
        on = gate.drafting(1, key="a")
        gate.observe(1, on, tokens=1, seconds=1 / (23.6 if on else 24.7), key="a")
    assert gate.log[-1][2:4] == ("plain", "interleaved") and not gate.mode(1, key="a")
    assert gate.mode(1, key="b")  # the next request: lookups (the model gate's trial)
    assert gate.log[-1][2:4] == ("lookup", "next request")
    modes = [gate.drafting(1, key="b") for _ in range(50)]
    assert all(modes)  # no trial till the retry interval: its plain verdict is over
    # unkeyed steps (batch 1 without request ids) keep the verdict as before
    other = LookupGate(trial_steps=16, retry_every=256)
    run_gate(other, 1, rate_on=23.6, rate_off=24.7, steps=40)
    assert not other.drafting(1) and not other.mode(1)


def test_a_tie_on_drafting_trial_on_the_next_request_keeps_drafting():
    """Batch 1: plain decoding wins on request 0 (scoped to it); request 1 drafts
    about as fast as plain decoding ran (a tie on the rates: paired on request 1,
    where the two tie again); request 2 drafts at twice the speed. The ties keep
    drafting on, on request 1 and after it (a tie once turned drafting off,
    unscoped, for a retry interval of steps)."""
    gate = DraftGate()
    modes = run_requests(gate, [120, 100, 100], [(20.0, 30.0), (29.8, 30.0), (60.0, 30.0)])
    assert not any(modes[0][-20:])  # plain decoding won on request 0
    # request 1: drafting's warm-up and trial, plain decoding's trial, drafting again
    assert modes[1] == [True] * 40 + [False] * 33 + [True] * 27
    assert all(modes[2])
    assert [tuple(e[1:4]) for e in gate.log][-3:] == [
        ("1", "on", "next request"), ("1", "off", "pairing"), ("1", "on", "paired")]


def test_drafting_a_little_faster_than_plain_decoding_on_other_requests_is_paired():
    """Batch 1, summaries in a row: lookups alone beat drafting on each, but the next
    one drafts faster than lookups ran on the one before (on the rates: 36 against
    30). Within ``pair_within`` of it, plain decoding's trial on the same request
    decides (45: plain decoding for the rest of it); far faster (70 against 30),
    drafting holds without one. Measured: summaries drafted at 27 tokens/s against
    22 kept drafting on the rates, where lookups alone ran them at 33."""
    gate = DraftGate()
    modes = run_requests(gate, [120, 140], [(20.0, 30.0), (36.0, 45.0)])
    assert modes[1][:40] == [True] * 40 and not any(modes[1][40:])
    assert [tuple(e[1:4]) for e in gate.log][-2:] == [("1", "off", "pairing"),
                                                     ("1", "off", "paired")]
    on, off = gate.log[-2][4:]  # the rates it paired on: drafting ahead, but within 1.5x
    assert on == pytest.approx(36.0) and off < on < 1.5 * off
    gate = DraftGate()
    modes = run_requests(gate, [120, 140], [(20.0, 30.0), (70.0, 45.0)])
    assert all(modes[1])
    assert [tuple(e[1:4]) for e in gate.log][-1] == ("1", "on", "rates")


def run_requests(gate, lengths, rates, keyed=True, told=True):
    """Batch-1 traffic: request i runs ``lengths[i]`` steps at ``rates[i]`` = (on, off)
    tokens/s (``keyed``: the steps are paired by request; ``told``: the gate also
    learns each step's request before it chooses). Returns the modes chosen per request."""
    modes = []
    for i, (n, (rate_on, rate_off)) in enumerate(zip(lengths, rates)):
        mine = []
        for _ in range(n):
            on = gate.drafting(1, key=i if keyed and told else None)
            mine.append(on)
            gate.observe(1, on, tokens=1, seconds=1 / (rate_on if on else rate_off),
                         key=i if keyed else None)
        modes.append(mine)
    return modes


def test_a_trial_on_a_request_that_is_fast_either_way_does_not_turn_drafting_off():
    """Batch 1, requests alternating: ones that copy their prompt (fast on or off, a
    little faster off) and ones only the draft makes fast. A trial of plain decoding
    that falls on a copying request is judged against drafting on that request, not
    on the last hard one: it holds for that request only."""
    lengths, rates = [100] * 15, [(100.0, 105.0), (70.0, 25.0)] * 7 + [(100.0, 105.0)]
    unpaired = run_requests(DraftGate(), lengths, rates, keyed=False)
    paired = run_requests(DraftGate(), lengths, rates)
    hard = lambda modes: [on for m in modes[1::2] for on in m]  # noqa: E731
    assert sum(hard(unpaired)) / len(hard(unpaired)) < 0.6  # drafting off for long stretches
    # drafting on every hard request; one after a copying request that plain decoding won
    # pays plain decoding's pairing trial (33 of its 100 steps)
    assert all(sum(m) >= 67 for m in paired[1::2])
    assert sum(hard(paired)) / len(hard(paired)) > 0.8
    # where plain decoding is faster on every request, the paired verdict finds it too
    modes = run_requests(DraftGate(), lengths, [(50.0, 100.0)] * 15)
    assert sum(on for m in modes[3:] for on in m) / sum(lengths[3:]) < 0.15


def test_a_paired_verdict_for_plain_decoding_holds_for_its_own_request_only():
    """Batch 1: one request the draft cannot follow (a long article) among requests it
    serves well. Plain decoding wins its trial on that request, paired; the next
    request tries drafting again at once rather than wait a retry interval."""
    lengths = [100] * 3 + [150] + [100] * 6
    rates = [(70.0, 25.0)] * 3 + [(20.0, 30.0)] + [(70.0, 25.0)] * 6
    modes = run_requests(DraftGate(), lengths, rates)
    assert sum(modes[3]) < 0.25 * len(modes[3])  # off for the rest of the hard request
    assert all(all(m[8:]) for m in modes[4:6])  # on from the next one (after its warm-up)
    # not told the step's request, the gate carries the verdict to the requests after it
    assert not any(run_requests(DraftGate(), lengths, rates, told=False)[4])
    # requests where drafting still loses: after two losses in a row the next request is
    # left to plain decoding, after three the next three (drafting's one more trial is
    # on request 6; a retry interval's trial falls on 8-9)
    modes = run_requests(DraftGate(), lengths, [(70.0, 25.0)] * 3 + [(20.0, 30.0)] * 7)
    assert [sum(m) > 0 for m in modes[4:8]] == [True, False, True, False]
    assert sum(on for m in modes[5:] for on in m) / sum(lengths[5:]) < 0.2
    gate = DraftGate()
    run_requests(gate, lengths[:4], rates[:4])
    assert gate.mode(1, key=3) is False and gate.mode(1, key=4) is True  # a peek


def test_the_next_request_after_a_verdict_for_plain_decoding_is_judged_on_itself():
    """Batch 1: plain decoding wins on an easy request (it copies its prompt, fast either
    way); drafting's trial on the next, hard request is then paired with plain decoding
    on that same request, not judged against the easy one's plain rate."""
    lengths, rates = [60, 100], [(60.0, 70.0), (26.0, 15.0)]
    modes = run_requests(DraftGate(trial_steps=10, warmup_steps=2), lengths, rates)
    assert not any(modes[0][-30:])  # plain decoding won on the easy request
    # the hard one: drafting's trial, plain decoding's on the same request, then drafting
    assert modes[1][:23] == [True] * 12 + [False] * 11 and all(modes[1][-50:])
    # where drafting also loses on the next request, the pairing finds that as well, and
    # plain decoding, the winner on two requests in a row, holds for the one after
    modes = run_requests(DraftGate(trial_steps=10, warmup_steps=2), lengths + [100],
                         [(60.0, 70.0), (15.0, 26.0), (15.0, 26.0)])
    assert not any(modes[1][-50:]) and not any(modes[2])


def test_a_verdict_on_rates_across_a_request_boundary_holds_for_its_last_request_only():
    """Batch 1: plain decoding's retry begins 2 steps before a request ends and runs on
    into the next, a request that copies its prompt (plain decoding at 200 tokens/s), so
    no request has both modes for a pair and plain decoding wins on rates partly measured
    elsewhere. It holds for that request; the one after tries drafting again at once,
    rather than wait a retry interval in plain decoding (measured: 580 steps off)."""
    lengths, rates = [282, 60, 100], [(40.0, 20.0), (30.0, 200.0), (40.0, 20.0)]
    gate = DraftGate(trial_steps=10, warmup_steps=2)
    modes = run_requests(gate, lengths, rates)
    assert ("1", "off", "rates") in [x[1:4] for x in gate.log]  # across the boundary
    assert not any(modes[1])  # plain decoding on the copying request
    assert sum(modes[2]) > 0.85 * len(modes[2])  # drafting again on the next one
    # where drafting also loses on the next request, plain decoding holds after it
    modes = run_requests(DraftGate(trial_steps=10, warmup_steps=2), lengths + [100],
                         rates[:2] + [(15.0, 26.0)] * 2)
    assert not any(modes[2][-50:]) and not any(modes[3])


def test_a_scope_ends_where_drafting_wins_again_on_its_request():
    """Plain decoding wins on request 1 (scoped to it); later in the same request the
    draft finds its footing and drafting wins its retry. The next request keeps
    drafting as it is: no fresh trial, and its measurements are not thrown away."""
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=50)
    for key, rates, n in [(0, (40.0, 20.0), 30), (1, (20.0, 40.0), 60),
                          (1, (40.0, 20.0), 60), (2, (40.0, 20.0), 20)]:
        for _ in range(n):
            on = gate.drafting(1, key=key)
            gate.observe(1, on, tokens=1, seconds=1 / rates[0 if on else 1], key=key)
    hows = [x[2:4] for x in gate.log]
    assert ("off", "paired") in hows and hows[-1] == ("on", "paired")
    assert ("on", "next request") not in hows


def test_the_log_keeps_each_trial_and_verdict_with_how_it_was_reached():
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100, reach=None)
    run_gate(gate, 16, rate_on=90.0, rate_off=100.0, steps=60)
    assert [x[1:4] for x in gate.log] == [("16", "off", "trial"), ("16", "off", "rates")]
    assert gate.log[1][4:] == (90.0, 100.0)  # tokens/s on, off
    gate = DraftGate()
    run_requests(gate, [100] * 3, [(40.0, 20.0)] * 3)
    assert ("1", "on", "paired", 40.0, 20.0) in [x[1:] for x in gate.log]


def test_a_trial_the_traffic_leaves_is_abandoned():
    """Batch 16 drains to 8-15 within a few dozen steps: a trial of drafting begun there
    must not leave batch 16 drafting for good, to be met again at the next burst."""
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100)
    run_gate(gate, 1, rate_on=40.0, rate_off=20.0, steps=60)  # batch 1 drafts
    # batch 16 starts plain, and tries drafting after a retry interval ...
    modes = run_gate(gate, 16, rate_on=150.0, rate_off=200.0, steps=105)
    assert not any(modes[:100]) and all(modes[-3:])
    run_gate(gate, 8, rate_on=120.0, rate_off=180.0, steps=100)  # ... as the batch drains
    modes = run_gate(gate, 16, rate_on=150.0, rate_off=200.0, steps=100)  # the next burst
    assert not any(modes)  # back to plain decoding, and no new trial for a retry interval
    # (too few of its steps measured to judge it: the mode before it)
    assert ("16", "off", "abandoned") in [x[1:4] for x in gate.log]
    # a trial that the traffic keeps coming back to is judged as before
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100, reach=None)
    for _ in range(10):
        run_gate(gate, 16, rate_on=150.0, rate_off=200.0, steps=4)
        run_gate(gate, 8, rate_on=120.0, rate_off=180.0, steps=4)
    assert ("16", "off", "rates", 150.0, 200.0) in [x[1:] for x in gate.log]


def test_a_trial_the_traffic_leaves_is_judged_where_it_measured_enough_steps():
    """Lookups at batch 16, then plain decoding's trial, which the traffic leaves 7 steps
    in (the batch drains to 8-15) although it measured 236 against 228 tokens/s: the
    next burst decodes plain. A trial left after 2 steps says nothing: the mode before
    it stays."""
    def burst(gate, steps):
        run_gate(gate, 16, rate_on=228.0, rate_off=236.0 * 1.03, steps=steps)
        run_gate(gate, 8, rate_on=200.0, rate_off=190.0, steps=80)  # the batch drains

    gate = DraftGate(trial_steps=16, warmup_steps=1, retry_every=256, reach=None)
    burst(gate, 24)  # 17 steps of lookups, plain decoding's trial 7 steps in
    modes = run_gate(gate, 16, rate_on=228.0, rate_off=236.0 * 1.03, steps=20)
    assert not any(modes)
    assert ("16", "off", "rates") in [x[1:4] for x in gate.log]
    gate = DraftGate(trial_steps=16, warmup_steps=1, retry_every=256, reach=None)
    burst(gate, 19)  # plain decoding's trial 2 steps in
    modes = run_gate(gate, 16, rate_on=228.0, rate_off=236.0 * 1.03, steps=20)
    assert all(modes)
    assert ("16", "on", "abandoned") in [x[1:4] for x in gate.log]


def test_modes_measured_at_different_batch_sizes_of_a_bucket_compare_per_request():
    """Bucket 8-15 as a batch of 16 drains: lookups measured at 13 requests (208
    tokens/s, 16.0 per request), plain decoding's trial at 9 (155 tokens/s, 17.2 per
    request). Per request plain decoding is the faster, and wins the trial."""
    gate = DraftGate(trial_steps=16, warmup_steps=1, retry_every=256, reach=None)
    modes = []
    for _ in range(17):  # lookups first, at 13
        on = gate.drafting(13)
        modes.append(on)
        gate.observe(13, on, tokens=13 * 1.2, seconds=13 * 1.2 / 208.0)
    for _ in range(20):  # then plain decoding's trial, the batch at 9
        on = gate.drafting(9)
        modes.append(on)
        gate.observe(9, on, tokens=9, seconds=9 / 155.0)
    assert modes[:17] == [True] * 17 and not any(modes[17:])
    assert ("8", "off", "rates") in [x[1:4] for x in gate.log]
    assert not gate.drafting(13)  # plain decoding holds at 13 too


def test_a_tie_on_the_rates_keeps_the_mode_from_before_the_trial():
    """A trial has to beat the mode it challenges by the margin, on the rates as on a
    pair: plain decoding's trial at 69.5 tokens/s against drafting's 69.0 (a 1% tie)
    once turned drafting off; the next request then lost paired (an easy one, fast
    without the model) and plain decoding held 223 steps over requests where drafting
    paid 1.5x. A tie keeps drafting on; and a retry of drafting that only ties plain
    decoding keeps plain decoding."""
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100)
    modes = run_gate(gate, 1, rate_on=69.0, rate_off=69.5, steps=100)
    assert modes[12:23] == [False] * 11  # plain decoding's trial ...
    assert ("1", "on", "rates") in [x[1:4] for x in gate.log]
    assert all(modes[23:100])  # ... lost the tie: drafting stays
    gate = DraftGate(trial_steps=10, warmup_steps=2, retry_every=100)
    run_gate(gate, 1, rate_on=40.0, rate_off=60.0, steps=60)  # plain decoding wins
    modes = run_gate(gate, 1, rate_on=60.5, rate_off=60.0, steps=200)
    # drafting's two retries (13 steps each, with its warm-up) tie: plain decoding stays
    assert sum(modes) == 2 * 13
    assert [x[2:4] for x in gate.log][-4:] == [("on", "trial"), ("off", "rates")] * 2


def test_requests_in_kinds_get_drafting_back_after_a_request_not_a_retry_interval():
    """Two requests that copy their prompt (faster without the model) and then ones only
    the draft makes fast, as a RAG burst gives way to chat: plain decoding wins on both
    copying requests, the next request is left to it, and drafting is back from the
    one after, rather than after a retry interval (223 steps off, measured once)."""
    lengths, rates = [100] * 7, [(60.0, 90.0)] * 2 + [(70.0, 25.0)] * 5
    gate = DraftGate()
    modes = run_requests(gate, lengths, rates)
    assert [x[2:4] for x in gate.log][:4] == [("off", "trial"), ("off", "paired"),
                                            ("on", "next request"), ("off", "pairing")]
    assert not any(modes[2])  # after two losses in a row: one request left to plain
    assert all(modes[3])  # drafting from the next (its trial won on the rates) ...
    assert all(sum(m) >= 67 for m in modes[4:])  # ... on (a retry of plain decoding aside)


def run_shadowed(gate, lengths, rates):
    """:func:`run_requests`, the proposer also telling the gate, for each drafting step
    it counted, what lookups alone would have done on the same tokens: ``rates[i]`` =
    (on, off, shadow) tokens/s."""
    modes = []
    for i, (n, (rate_on, rate_off, rate_shadow)) in enumerate(zip(lengths, rates)):
        mine = []
        for _ in range(n):
            on = gate.drafting(1, key=i)
            mine.append(on)
            counted = gate.observe(1, on, tokens=1, seconds=1 / (rate_on if on else rate_off),
                                   key=i)
            if on and counted:
                gate.observe_shadow(1, i, tokens=2, seconds=2 / rate_shadow)
        modes.append(mine)
    return modes


def test_lookups_alone_on_the_same_tokens_judge_drafting_without_a_trial():
    """Batch 1 greedy, the shadow told: where drafting beats lookups alone on each
    request, plain decoding never runs (its trial, due at step 41 and every retry
    interval, is judged on the shadow); a summary that lookups alone copy faster
    turns drafting off once drafting measured ``shadow_steps`` of it, for the rest of
    it only; the next request drafts again."""
    gate = DraftGate()
    modes = run_shadowed(gate, [100] * 4, [(40.0, 20.0, 25.0)] * 4)
    assert all(all(m) for m in modes) and gate.plain_steps == 0
    assert [tuple(e[1:4]) for e in gate.log][0] == ("1", "on", "shadow")
    gate = DraftGate()
    modes = run_shadowed(gate, [100] * 3, [(40.0, 20.0, 25.0), (26.0, 33.0, 33.0),
                                           (40.0, 20.0, 25.0)])
    assert modes[1] == [True] * 16 + [False] * 84  # judged at its 16th drafting step
    on, off = gate.log[1][4:]
    assert [tuple(e[1:4]) for e in gate.log][1] == ("1", "off", "shadow")
    assert (on, off) == (pytest.approx(26.0), pytest.approx(33.0))
    # the next request: drafting's trial (warm-up, then the shadow's verdict), kept
    assert all(modes[2]) and [tuple(e[2:4]) for e in gate.log][-2:] == [
        ("on", "next request"), ("on", "shadow")]


def test_a_trial_that_runs_into_the_next_request_waits_for_that_requests_shadow():
    """Drafting's trial on request 1 (after a verdict for plain decoding on request 0)
    outlives that short request: at its end request 2 has 4 steps measured. The
    verdict waits for request 2's own shadow (16 steps), rather than pair plain
    decoding's trial there or judge on rates partly measured on request 1 (a
    benchmark did both, then judged on the shadow 16 steps later anyway)."""
    gate = DraftGate()
    modes = run_shadowed(gate, [100, 36, 100], [(26.0, 33.0, 33.0), (60.0, 20.0, 25.0),
                                                (16.0, 20.0, 20.0)])
    assert modes[2] == [True] * 16 + [False] * 84
    assert [tuple(e[2:4]) for e in gate.log][-2:] == [("on", "next request"),
                                                      ("off", "shadow")]


def test_without_a_shadow_plain_decoding_is_tried_as_before():
    """Steps without a shadow (batch > 1, sampled, or no lent step measured yet) keep
    plain decoding's trials: the shadow of another request judges nothing."""
    gate = DraftGate()
    for _ in range(60):
        on = gate.drafting(1, key=0)
        if gate.observe(1, on, tokens=1, seconds=1 / 40.0, key=0) and on:
            gate.observe_shadow(1, 0, tokens=1, seconds=1 / 25.0)
    # the shadow judged at step 41: plain decoding's next trial falls due a retry
    # interval later, inside request 1, which has no shadow: that trial runs
    modes = []
    for _ in range(300):
        modes.append(gate.drafting(1, key=1))
        gate.observe(1, modes[-1], tokens=1, seconds=1 / (40.0 if modes[-1] else 20.0), key=1)
    assert not all(modes)
    assert ("off", "trial") in [tuple(e[2:4]) for e in gate.log]
