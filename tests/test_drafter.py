import threading

import numpy as np
import pytest

from duo_vllm.draft.drafter import DraftPolicy, DuoDrafter
from duo_vllm.control.drafting import CATCH_UP, PREFILL_CHUNK
from duo_vllm.control.goodput import PROBE_EVERY
from duo_vllm.runtime.message import StepRequest
from tests.support.fakes import FakeBackend, hint_of, wait_idle


def ctx(*xs):
    return np.array(xs, dtype=np.int32)


def serial(k=4, **kw):
    """Serial drafting; a fixed budget of k unless given (the controller is tested apart)."""
    kw.setdefault("budget", k)
    return DraftPolicy(k=k, parallel=False, **kw)


def make(policy, backend=None, n_ctx=100, seqs=4):
    be = backend or FakeBackend()
    return be, DuoDrafter(be, max_sequences=seqs, n_ctx=n_ctx, policy=policy)


def test_serial_greedy_chain_follows_argmax():
    be, d = make(serial())
    (draft,) = d.propose(StepRequest([ctx(1, 2, 3)], [4]))
    assert draft == be.chain(3, 4)
    assert d.jobs == []  # serial: nothing is pre-drafted


def test_only_new_tokens_are_evaluated():
    be, d = make(serial(k=3))
    (draft,) = d.propose(StepRequest([ctx(1, 2, 3)], [3]))
    be.evaluated.clear()
    # the target accepted the first two draft tokens and sampled 9
    (draft2,) = d.propose(StepRequest([ctx(1, 2, 3, draft[0], draft[1], 9)], [3]))
    assert be.evaluated[0][1:] == ([9], 5)  # only the new token, at its position
    assert draft2 == be.chain(9, 3)
    assert d.stats.reused_tokens == 5


def test_fully_known_context_reevaluates_last_token_for_logits():
    be, d = make(serial(k=3), seqs=1)
    d.propose(StepRequest([ctx(1, 2, 3)], [3]))
    be.evaluated.clear()
    (draft,) = d.propose(StepRequest([ctx(1, 2, 3)], [2]))
    assert be.evaluated[0][1:] == ([3], 2)
    assert draft == be.chain(3, 2)


def test_rows_are_drafted_in_one_decode_per_depth():
    be, d = make(serial(k=3))
    out = d.propose(StepRequest([ctx(1, 2), ctx(10, 11, 12)], [2, 3]))
    assert out == [be.chain(2, 2), be.chain(12, 3)]
    assert be.decode_calls == 3  # catch-up for both, then 2 more depths


def test_context_too_long_or_zero_budget_gets_no_draft():
    be, d = make(serial(k=5), n_ctx=5)
    assert d.propose(StepRequest([ctx(1, 2, 3, 4), ctx(1)], [2, 0])) == [[], []]
    assert d.propose(StepRequest([ctx(1, 2, 3)], [5])) == [be.chain(3, 1)]  # clamped to fit n_ctx


@pytest.mark.expect_swallowed(RuntimeError, reason="the backend's injected failure")
def test_backend_error_gives_no_draft_and_resets_slot():
    class Broken(FakeBackend):
        def decode(self, items):
            raise RuntimeError("boom")

    _, d = make(serial(), backend=Broken(), seqs=1)
    assert d.propose(StepRequest([ctx(1, 2)], [3])) == [[]]
    assert d.stats.errors == 1 and len(d.pool.slots[0].tokens) == 0


def test_fixed_budget_sets_the_chain_length():
    be, d = make(serial(k=4, budget=2))
    assert d.propose(StepRequest([ctx(1, 2)], [4])) == [be.chain(2, 2)]
    _, d0 = make(serial(k=4, budget=0))
    assert d0.propose(StepRequest([ctx(1, 2)], [4])) == [[]]


# -- parallel: pre-drafting and branches ---------------------------------------

def parallel(k=3, **kw):
    return DraftPolicy(k=k, parallel=True, budget=kw.pop("budget", 3), **kw)


def test_predraft_hit_serves_the_branch_without_evaluating():
    be, d = make(parallel(multi_sequence=False))
    (draft,) = d.propose(StepRequest([ctx(1, 2)], [3]))
    d.predraft()
    tree = d.trees[0]
    b = be.next_token(draft[-1])  # the target accepts everything and samples b
    assert tree.branches[0].tokens[0] == b
    be.evaluated.clear()
    (draft2,) = d.propose(StepRequest([ctx(1, 2, *draft, b)], [3]))
    assert draft2 == be.chain(b, 3)
    assert be.evaluated == []  # nothing evaluated on the critical path
    assert d.stats.predraft_hits == 1
    assert d.stats.misses == {"unplanned": 1}  # only the first step, before any pre-draft


def test_partial_accept_is_a_miss_and_drafts_from_the_real_context():
    be, d = make(parallel(multi_sequence=False))
    (draft,) = d.propose(StepRequest([ctx(1, 2)], [3]))
    d.predraft()
    (draft2,) = d.propose(StepRequest([ctx(1, 2, draft[0], 44)], [3]))  # rejected at position 2
    assert draft2 == be.chain(44, 3)
    assert d.stats.predraft_hits == 0 and d.stats.predraft_lookups == 1
    assert d.stats.misses == {"unplanned": 1, "rejected": 1}
    d.predraft()
    assert list(d.trees[0].prefix) == [1, 2, draft[0], 44, *draft2]
    # the target accepts the draft but its next token is on no branch
    d.propose(StepRequest([ctx(1, 2, draft[0], 44, *draft2, 99)], [3]))
    assert d.stats.misses["bonus"] == 1
    # a pre-draft planned but never run (vLLM came back first): no tree, cut
    d.propose(StepRequest([ctx(1, 2, draft[0], 44, *draft2, 99, 5)], [3]))
    assert d.stats.misses["cut"] == 1 and d.stats.as_dict()["predraft_misses"]["cut"] == 1


def unsure_backend():
    # 9 -> 5 surely; after 5 the draft hesitates between 20 (p .44), 21 (p .36) and
    # 22 (p .06); after 20 it is unsure too (top p .40), so θ = .44 * .40 = .18:
    # 21 opens a branch, 22 does not.
    spread = {9: {5: 12.0}, 5: {20: 5.0, 21: 4.8, 22: 3.0}, 20: {7: 4.0, 8: 3.5}}
    return FakeBackend(spread=spread)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_theta_rule_opens_branches_and_a_second_branch_can_hit():
    be = unsure_backend()
    p1, p2 = softmax(be.logits_after(5)), softmax(be.logits_after(20))
    theta = p1[20] * p2.max()
    assert p1[21] > theta > p1[22]  # the hand-built case is what the comment says
    _, d = make(parallel(k=3, budget=4, multi_sequence=True), backend=be)
    assert d.propose(StepRequest([ctx(1, 9)], [1])) == [[5]]
    d.predraft()  # pre-drafts for the position after 5
    tree = d.trees[0]
    assert [br.tokens[0] for br in tree.branches] == [20, 21]
    assert d.stats.branch_counts[2] == 1
    be.evaluated.clear()
    # the target sampled the 2nd candidate
    (draft,) = d.propose(StepRequest([ctx(1, 9, 5, 21)], [3]))
    assert len(draft) >= 1 and draft == be.chain(21, len(draft))
    assert be.evaluated == [] and d.stats.branch_hits[1] == 1
    assert be.seqs[0][:4] == [1, 9, 5, 21]  # the branch became the request's sequence
    d.predraft()
    (draft2,) = d.propose(StepRequest([ctx(1, 9, 5, 21, *draft, be.next_token(draft[-1]))], [3]))
    assert d.stats.predraft_hits == 2


def test_multi_sequence_off_keeps_one_branch():
    be = unsure_backend()
    _, d = make(parallel(k=3, budget=4, multi_sequence=False), backend=be)
    d.propose(StepRequest([ctx(1, 9)], [1]))
    d.predraft()
    assert [br.tokens[0] for br in d.trees[0].branches] == [20]
    # capped at k=3 evaluations: the candidate plus a full draft of 3
    assert len(d.trees[0].branches[0].tokens) == 4


def test_predraft_stops_when_interrupted():
    be, d = make(parallel(k=3, budget=3, multi_sequence=False))
    d.propose(StepRequest([ctx(1, 2)], [3]))
    calls = []
    d.predraft(interrupt=lambda: calls.append(1) or len(calls) > 1)
    assert d.stats.interrupted == 1
    assert len(d.trees[0].branches[0].tokens) == 2  # catch-up + top-1 only


def test_sequences_stay_consistent_over_many_steps():
    """Random accept/reject pattern: every context the drafter sees must match its KV."""
    rng = np.random.default_rng(0)
    be = FakeBackend(spread={3: {10: 5.0, 11: 4.8}, 17: {4: 5.0, 30: 4.9}})
    d = DuoDrafter(be, max_sequences=2, n_ctx=400,
                   policy=DraftPolicy(k=4, parallel=True, budget=4, multi_sequence=True))
    seqs = [[1, 2], [40, 41, 42]]
    for _ in range(60):
        drafts = d.propose(StepRequest([ctx(*s) for s in seqs], [4, 4]))
        for s, dr in zip(seqs, drafts):
            n_acc = rng.integers(0, len(dr) + 1)
            s.extend(dr[:n_acc])
            s.append(int(rng.integers(0, 50)) if rng.random() < 0.3 else be.next_token(s[-1]))
        d.predraft()
        for slot in d.pool.slots:  # the KV holds exactly what the slot says
            assert be.seqs.get(slot.seq_id, []) == [int(t) for t in slot.tokens]
    assert d.stats.predraft_hits > 0 and d.stats.errors == 0


class FixedDraftTime:
    """D(w) pinned to ``per_call_s + per_token_s · (w - 1)`` (a fake backend's own is µs)."""

    def __init__(self, per_call_s, per_token_s=0.0):
        self.per_call_s, self.per_token_s = per_call_s, per_token_s

    def __call__(self, w):
        return 0.0 if w <= 0 else self.per_call_s + self.per_token_s * (w - 1)

    def observe(self, width, seconds):
        pass

    def table(self):
        return {}


def auto(**kw):
    return DraftPolicy(k=4, parallel=True, budget=None, **{"multi_sequence": False, **kw})


def test_controller_pre_drafts_what_fits_the_step_and_stops_at_the_deadline():
    be, d = make(auto())
    d.draft_time = FixedDraftTime(0.010)
    d.propose(StepRequest([ctx(1, 2)], [4], 0.05, per_token_s=0.002))
    # the deadline is the step under way, as planned: T₀ + c · (tokens served)
    served = d.last_draft[0][1]
    assert d.deadline_after(10.0) == pytest.approx(10.05 + 0.002 * len(served))
    job = d.jobs[0]
    assert 1 <= job.evals <= 4  # catch-up + evals calls of 10 ms fit in the 50 ms step
    d.predraft(deadline=0.0)  # already past: the catch-up only (the slot stays in sync)
    assert d.trees[0].branches[0].tokens == be.chain(int(d.trees[0].prefix[-1]), 1)


def _one_deep_hit(draft_call_s):
    """A pre-draft one token deep (its deadline came), then the step that hits it."""
    be, d = make(auto())
    d.draft_time = FixedDraftTime(0.002)
    (draft,) = d.propose(StepRequest([ctx(1, 2)], [4], 0.05, per_token_s=0.0005))
    b = be.next_token((draft or [2])[-1])  # the target accepts the draft and samples b
    d.jobs[0].evals = 1
    d.predraft()
    assert d.trees[0].branches[0].tokens == [b, be.next_token(b)]
    d.draft_time = FixedDraftTime(draft_call_s)
    calls = be.decode_calls
    (draft2,) = d.propose(StepRequest([ctx(1, 2, *draft, b)], [4], 0.05, per_token_s=0.0005))
    return be, d, b, draft2, be.decode_calls - calls


def test_a_hit_whose_branch_ran_out_serves_its_branch_only():
    """The pre-draft's deadline cut its branch at one token: the step serves that token
    and drafts nothing on from the branch's end, however cheap a draft call."""
    be, d, b, draft, calls = _one_deep_hit(0.002)
    assert draft == be.chain(b, 1) and calls == 0 and d.stats.predraft_hits == 1


def test_controller_drafts_nothing_when_drafting_does_not_pay():
    be, d = make(auto())
    d.draft_time = FixedDraftTime(1.0)  # a draft call costs 20 target steps
    for i in range(3):
        assert d.propose(StepRequest([ctx(1, 2, *range(3, 3 + i))], [4], 0.05,
                                     per_token_s=0.002)) == [[]]
        assert d.jobs == []  # and spends no draft work on the next step either
    assert be.decode_calls == 0
    assert d.stats.floor_steps == 3 and d.stats.chosen_lengths == {0: 3}


def test_a_miss_with_a_good_lookup_copy_is_not_drafted_on_the_spot():
    """vLLM does not wait for a model draft where the request's lookup draft, served
    anyway, is as likely accepted: the draft core pre-drafts from the copy's end."""

    def step(hint):
        be, d = make(auto())
        d.draft_time = FixedDraftTime(0.012, 0.001)
        (draft,) = d.propose(StepRequest([ctx(1, 2, 3)], [4], 0.045, per_token_s=0.0015,
                                         hints=[hint]))
        return be, d, draft

    be, d, draft = step(None)  # no copy: drafted on the spot
    assert draft and d.stats.sync_calls == 1 and d.stats.lookup_misses == 0
    copy = [7, 7, 7, 7]
    be, d, draft = step(hint_of(copy, 0.88, 0.9, 0.0))
    assert draft == [] and be.decode_calls == 0 and d.stats.sync_calls == 0
    assert d.stats.lookup_misses == 1
    assert list(d.jobs[0].prefix) == [1, 2, 3, *copy]  # pre-drafted from the copy's end
    be, d, draft = step(hint_of(copy, 0.88, 0.1, 0.0))  # a copy it rarely accepts
    assert draft and d.stats.sync_calls == 1


def test_controller_verifying_too_expensive_gives_zero_then_probes():
    be, d = make(auto())
    d.draft_time = FixedDraftTime(0.001)
    seq = [1, 2]
    steps = 0
    while not d.jobs:  # c = T₀: a verified token costs a whole step
        assert d.propose(StepRequest([ctx(*seq)], [4], 0.05, per_token_s=0.05)) == [[]]
        seq.append(be.next_token(seq[-1]))
        steps += 1
    assert steps == PROBE_EVERY and d.stats.probes == 1
    assert d.jobs[0].evals == 1  # a one-token probe: acceptance may have risen


def test_controller_never_probes_a_row_whose_prompt_is_not_evaluated():
    """At the floor, a probe of a row the draft holds nothing of would be a whole
    prefill of draft work for one probed token: none is planned."""
    be, d = make(auto(), n_ctx=1000)
    d.draft_time = FixedDraftTime(0.001)
    freeze_timings(d, token_s=0.015, prefill_s=0.006)
    seq = [(7 * i) % 50 for i in range(150)]  # a long prompt, never prefetched
    for _ in range(2 * PROBE_EVERY):  # c = T₀: a verified token costs a whole step
        assert d.propose(StepRequest([ctx(*seq)], [4], 0.05, per_token_s=0.05)) == [[]]
        assert d.jobs == []
        seq.append(be.next_token(seq[-1]))
    assert d.stats.probes == 0 and be.decode_calls == 0


def test_a_request_that_ends_before_the_draft_could_catch_up_is_left_to_the_target():
    """The tail of a batch that drained from a size where drafting was off: the draft
    holds nothing of the requests left, and catching up on 150 tokens (0.9 s) takes
    longer than a request with 10 tokens to go lives (0.5 s): nothing is queued."""
    be, d = make(auto(), n_ctx=1000)
    d.draft_time = FixedDraftTime(0.001)
    freeze_timings(d, token_s=0.015, prefill_s=0.006)
    seq = [(7 * i) % 50 for i in range(150)]
    assert d.propose(StepRequest([ctx(*seq)], [4], 0.05, per_token_s=0.002, remaining=[10])) == [[]]
    assert d.jobs == [] and d.stats.short_lived == 1 and be.decode_calls == 0
    # the same request with 100 tokens to go (5 s): caught up in the background
    assert d.propose(StepRequest([ctx(*seq, 1)], [4], 0.05, per_token_s=0.002,
                                 remaining=[100])) == [[]]
    assert len(d.jobs) == 1 and d.stats.short_lived == 1
    # unknown: as before, caught up
    be, d = make(auto(), n_ctx=1000)
    d.draft_time = FixedDraftTime(0.001)
    freeze_timings(d, token_s=0.015, prefill_s=0.006)
    d.propose(StepRequest([ctx(*seq)], [4], 0.05, per_token_s=0.002))
    assert len(d.jobs) == 1


def test_a_request_whose_last_step_is_under_way_is_not_pre_drafted():
    """A request whose step under way reaches its max_tokens if it accepts the draft
    (the pre-draft's root) ends there: the draft side goes idle instead, so the next
    request's prefill finds the draft's core free."""
    def first_step(remaining):
        be, d = make(auto())
        d.draft_time = FixedDraftTime(0.010)
        d.propose(StepRequest([ctx(1, 2)], [4], 0.05, per_token_s=0.002,
                              remaining=remaining))
        return d

    d = first_step(None)
    served = len(d.last_draft[0][1])
    assert len(d.jobs) == 1 and d.stats.short_lived == 0
    d = first_step([served + 1])  # the served draft, accepted, and the bonus: its end
    assert d.jobs == [] and d.stats.short_lived == 1
    d = first_step([served + 2])  # one token more to go: the next step comes
    assert len(d.jobs) == 1 and d.stats.short_lived == 0


def test_controller_serves_more_to_requests_that_accept_more():
    be, d = make(auto(), seqs=2)
    d.draft_time = FixedDraftTime(0.002)
    good, poor = [1, 2], [30, 31]
    for _ in range(12):
        drafts = d.propose(StepRequest([ctx(*good), ctx(*poor)], [4, 4], 0.05, per_token_s=0.004))
        d.predraft()
        good += drafts[0] + [be.next_token((drafts[0] or good)[-1])]  # all accepted
        poor += [(poor[-1] + 1) % 50]  # the target never agrees with the draft
    assert len(drafts[0]) == 4 and len(drafts[1]) < 4
    assert d.acceptance.alpha(0, "greedy") > 0.9
    assert d.acceptance.alpha(1, "greedy") < d.acceptance.alpha(0, "greedy") - 0.3


def freeze_timings(d, token_s, prefill_s):
    """Pin the drafter's measured times (a fake backend's own would be microseconds)."""
    for ema, value in ((d.token_s, token_s), (d.prefill_s, prefill_s)):
        ema.value = value
        ema.add = lambda x: None


def test_long_new_context_is_prefilled_in_the_background_in_chunks():
    be = FakeBackend()
    d = DuoDrafter(be, max_sequences=2, n_ctx=1000,
                   policy=DraftPolicy(k=3, parallel=True, multi_sequence=False, budget=3))
    freeze_timings(d, token_s=0.015, prefill_s=0.006)
    prompt = ctx(*[(7 * i) % 50 for i in range(150)])
    # vLLM does not wait for a 150-token prefill
    assert d.propose(StepRequest([prompt], [3])) == [[]]
    assert be.evaluated == []
    calls = []
    # asked before each chunk: the third time, after two chunks, a step is waiting
    d.predraft(interrupt=lambda: calls.append(1) or len(calls) >= 3)
    assert len(d.pool.slots[0].tokens) == 2 * PREFILL_CHUNK and 0 not in d.trees
    # the next step: still prefilling, so again no draft; the prefill resumes where it was
    b = be.next_token(int(prompt[-1]))
    grown = np.append(prompt, np.int32(b))
    assert d.propose(StepRequest([grown], [3])) == [[]]
    be.evaluated.clear()
    d.predraft()
    assert be.evaluated[0][2] == 2 * PREFILL_CHUNK  # resumed, not restarted
    (draft,) = d.propose(StepRequest([np.append(grown, np.int32(be.next_token(b)))], [3]))
    assert draft == be.chain(be.next_token(b), 3) and d.stats.predraft_hits == 1


def test_new_prompts_share_prefill_chunks_shortest_first_and_hold_back_no_tree():
    # vLLM's offline batch: prompts of 300, 100 and 3 tokens arrive together
    be, d = make(parallel(multi_sequence=False, budget=3), n_ctx=1000)
    freeze_timings(d, token_s=0.015, prefill_s=0.006)
    sizes = []
    decode = be.decode
    be.decode = lambda items: sizes.append(sum(len(t) for _, t, _ in items)) or decode(items)
    prompts = [ctx(*[(7 * i) % 50 for i in range(300)]), ctx(*[(3 * i) % 50 for i in range(100)]),
               ctx(5, 6, 7)]
    assert d.prefetch(prompts) == 3
    slot = {name: job.slot_id for name, job in zip("abs", d.jobs)}

    def chunks():
        return [(seq, len(t)) for seq, t, _ in be.evaluated if len(t) > CATCH_UP]

    d.predraft(interrupt=lambda: bool(chunks()))  # a step comes after one prefill chunk
    assert list(d.trees) == [slot["s"]]  # the short prompt's branches did not wait
    assert chunks() == [(slot["b"], PREFILL_CHUNK)]  # the shorter long prompt first
    # the step: the short request is served from its tree, the others wait for theirs
    grown = [np.append(p, np.int32(be.next_token(int(p[-1])))) for p in prompts]
    drafts = d.propose(StepRequest(grown, [3] * 3))
    assert drafts[2] == be.chain(int(grown[2][-1]), 3) and drafts[:2] == [[], []]
    d.predraft()
    assert sorted(d.trees) == sorted(slot.values())
    assert max(sizes) <= PREFILL_CHUNK  # no decode call outlasts one chunk
    again = [np.append(g, np.int32(be.next_token(int(g[-1])))) for g in grown[:2]]
    accepted = np.concatenate([grown[2], drafts[2]])  # all of the short one's draft, + bonus
    again.append(np.append(accepted, np.int32(be.next_token(int(accepted[-1])))))
    drafts = d.propose(StepRequest(again, [3] * 3))
    assert drafts[:2] == [be.chain(int(g[-1]), 3) for g in again[:2]]
    assert d.stats.predraft_hits == 4


class SlowBackend(FakeBackend):
    """A fake backend that takes ``token_s`` seconds per evaluated token."""

    def __init__(self, token_s):
        super().__init__()
        self.token_s = token_s

    def decode(self, items):
        import time

        time.sleep(self.token_s * sum(len(t) for _, t, _ in items))
        return super().decode(items)


def slow_worker(token_s, **cfg):
    from duo_vllm.runtime.actor import DraftWorker

    be = SlowBackend(token_s)
    cfg = {"use_actor": False, "budget": 3, "multi_sequence": False, **cfg}
    return be, DraftWorker(cfg, "fake.gguf", None, k=3, backend_factory=lambda _: be)


class GatedBackend(FakeBackend):
    """A fake backend whose decode calls the test holds: after :meth:`hold`, each call
    waits until :meth:`release` (``entered`` is set as one starts, ``under_way``
    counts those inside). What the worker did while a call was held shows what it
    waited for, with no clock: a call still held after some method returned was
    not waited for. A call held past ``BOUND_S`` goes on by itself and counts in
    ``expired`` (a test that waits for it fails instead of hanging)."""

    BOUND_S = 30.0

    def __init__(self):
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()
        self.started = self.under_way = self.expired = 0
        self.events: list[str] = []  # "decode ended" after each call held

    def hold(self) -> None:
        self.entered.clear()
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def decode(self, items):
        self.started += 1
        self.under_way += 1
        self.entered.set()
        held = not self.gate.is_set()
        try:
            if not self.gate.wait(self.BOUND_S):
                self.expired += 1
            return super().decode(items)
        finally:
            self.under_way -= 1
            if held:
                self.events.append("decode ended")


def gated_worker(token_s=0.01, **cfg):
    """A parallel DraftWorker on a :class:`GatedBackend`, its measured times pinned
    (a held call would otherwise be measured as a very slow one)."""
    from duo_vllm.runtime.actor import DraftWorker

    be = GatedBackend()
    cfg = {"use_actor": False, "budget": 3, "multi_sequence": False, **cfg}
    w = DraftWorker(cfg, "fake.gguf", None, k=3, backend_factory=lambda _: be)
    freeze_timings(w.drafter, token_s=token_s, prefill_s=token_s)
    return be, w


def test_worker_never_makes_vllm_wait_for_a_prefill():
    be, w = gated_worker(0.02)
    try:
        be.hold()  # every decode call from here waits for the test
        prompt = ctx(*[(3 * i) % 50 for i in range(100)])  # prefilled in the background
        assert w.propose(StepRequest([prompt], [3], 0.05)) == [[]]
        assert be.entered.wait(30)  # the background prefill is under way, held
        seq = prompt
        for _ in range(3):  # vLLM decodes on without drafts
            seq = np.append(seq, np.int32(be.next_token(int(seq[-1]))))
            assert w.propose(StepRequest([seq], [3], 0.05)) == [[]]
        # every step returned while the prefill's decode call was still held: none
        # waited for it (a wait would have lasted until the hold's bound ran out)
        assert be.under_way == 1 and be.expired == 0
        assert w.drafter.stats.skipped_busy >= 3
        be.release()
        assert wait_idle(w, timeout=10)
        seq = np.append(seq, np.int32(be.next_token(int(seq[-1]))))
        (draft,) = w.propose(StepRequest([seq], [3], 0.05))
        assert draft == be.chain(int(seq[-1]), 3) and be.expired == 0
    finally:
        be.release()
        w.close()


def test_prefetched_prompt_is_prefilled_before_its_first_step_and_hits():
    be, d = make(parallel(multi_sequence=False, budget=3), n_ctx=1000)
    prompt = ctx(*[(7 * i) % 50 for i in range(150)])
    assert d.prefetch([prompt]) == 1  # vLLM is about to prefill it
    d.predraft()  # the draft prefills meanwhile, and drafts past the prompt
    assert len(d.pool.slots[0].tokens) >= len(prompt) and 0 in d.trees
    b = be.next_token(int(prompt[-1]))  # the token the target samples after its prefill
    be.evaluated.clear()
    (draft,) = d.propose(StepRequest([np.append(prompt, np.int32(b))], [3]))
    assert draft == be.chain(b, 3)  # served at the first step, nothing evaluated
    assert be.evaluated == [] and d.stats.predraft_hits == 1
    assert d.stats.steps == 1 and d.stats.prefetched_prompts == 1
    assert 0 < d.stats.as_dict()["busy_fraction"] <= 1  # the prefill counts, from its start


def test_a_prefetched_slot_is_free_again_once_its_request_came_and_went():
    """A prefetched prompt's slot is held for it until its request shows up; after
    that the request's slot is an ordinary one: when it has finished, the next new
    prompt may take it (before, the queued name held it for QUEUED_TTL calls, and a
    pool full of such slots left new prompts without a draft)."""
    be, d = make(parallel(multi_sequence=False, budget=3), n_ctx=1000, seqs=1)
    first = ctx(*[(7 * i) % 50 for i in range(40)])
    assert d.prefetch([first]) == 1
    d.predraft()
    d.propose(StepRequest([np.append(first, np.int32(be.next_token(int(first[-1]))))], [3]))
    assert d.pool.slots[0].queued is None  # named by its request now, not by the prompt
    d.live = set()  # the request finished: the next step does not have it
    second = ctx(*[(3 * i + 1) % 50 for i in range(40)])
    assert d.prefetch([second]) == 1 and d.stats.no_slot == 0

def test_prefetch_is_off_in_serial_mode_and_gives_each_request_its_slot():
    be, d = make(serial())
    assert d.prefetch([ctx(1, 2, 3)]) == 0 and d.jobs == []
    be, d = make(parallel(multi_sequence=False, budget=3))
    assert d.prefetch([ctx(1, 2, 3), ctx(1, 2, 3)]) == 2  # two requests, one prompt (n=2)
    assert sorted(j.slot_id for j in d.jobs) == [0, 1]
    d.predraft()
    assert [list(d.pool.slots[i].tokens[:3]) for i in (0, 1)] == [[1, 2, 3]] * 2


def test_worker_prefetch_returns_at_once_and_the_first_step_hits():
    from duo_vllm.runtime.actor import DraftWorker

    be, w = gated_worker(0.002)
    try:
        be.hold()
        prompt = ctx(*[(3 * i) % 50 for i in range(200)])
        assert w.prefetch([prompt]) == 1
        # vLLM's step is not held up: the prefill runs in the background, held by the
        # test after prefetch() returned
        assert be.entered.wait(30) and be.under_way == 1
        be.release()
        assert wait_idle(w, timeout=10)  # meanwhile the target prefills
        b = be.next_token(int(prompt[-1]))
        (draft,) = w.propose(StepRequest([np.append(prompt, np.int32(b))], [3], 0.05))
        assert draft == be.chain(b, 3)
        s = w.stats()
        assert s["predraft_hits"] == 1 and s["prefetched_prompts"] == 1
        assert s["skipped_busy"] == 0
        assert be.expired == 0
    finally:
        be.release()
        w.close()
    serial_worker = DraftWorker({"use_actor": False, "parallel": False}, "fake.gguf", None,
                                k=3, backend_factory=lambda _: FakeBackend())
    assert serial_worker.prefetch([ctx(1, 2)]) == 0


def test_a_long_prompt_in_the_background_never_blanks_the_other_rows():
    import time

    be, w = slow_worker(0.002, budget=2)  # 2 ms a token: 300 prompt tokens take 0.6 s
    freeze_timings(w.drafter, token_s=0.002, prefill_s=0.002)
    try:
        short = ctx(1, 2, 3)
        assert w.propose(StepRequest([short], [2], 0.2)) == [be.chain(3, 2)]  # a request decoding
        assert wait_idle(w, timeout=10)
        long_prompt = ctx(*[(3 * i) % 50 for i in range(300)])
        assert w.prefetch([long_prompt]) == 1  # a new request: prefilled in the background
        time.sleep(0.05)
        seq = np.concatenate([short, be.chain(3, 2)])
        seq = np.append(seq, np.int32(be.next_token(int(seq[-1]))))
        for _ in range(3):  # steps while the prompt is still being prefilled
            grown = np.append(long_prompt, np.int32(be.next_token(int(long_prompt[-1]))))
            drafts = w.propose(StepRequest([seq, grown], [2, 2], 0.2))
            assert drafts[0] == be.chain(int(seq[-1]), 2)  # served, not blanked
            seq = np.concatenate([seq, drafts[0]])
            seq = np.append(seq, np.int32(be.next_token(int(seq[-1]))))
            time.sleep(0.05)
        assert w.drafter.stats.skipped_busy == 0
        # the prefill went on in chunks sized to a fraction of the target step
        assert max(len(t) for _, t, _ in be.evaluated) <= PREFILL_CHUNK
    finally:
        w.close()


def test_serial_controller_probes_a_quiet_request_on_the_spot():
    be, d = make(DraftPolicy(k=4, parallel=False, budget=None))
    d.draft_time = FixedDraftTime(1.0)  # drafting looks hopeless: nothing is planned
    seq = [1, 2]
    drafts = []
    for _ in range(PROBE_EVERY + 1):
        (draft,) = d.propose(StepRequest([ctx(*seq)], [4], 0.05, per_token_s=0.002))
        drafts.append(draft)
        seq.append(be.next_token(seq[-1]))
    assert drafts[:PROBE_EVERY] == [[]] * PROBE_EVERY
    assert len(drafts[-1]) == 1 and d.stats.probes == 1  # one token, to measure again


def test_stats_do_not_wait_out_a_background_prefill():
    """Ray queues the next step's propose() behind a stats call: stats must not hold
    it for a whole background prefill (that read as a stalled actor), nor stop it."""
    be, w = gated_worker(0.01)
    try:
        be.hold()
        prompt = ctx(*[(3 * i) % 50 for i in range(200)])
        assert w.prefetch([prompt]) == 1
        assert be.entered.wait(30)  # a prefill chunk under way, held
        assert w.stats()["prefetched_prompts"] == 1
        assert be.under_way == 1  # answered while the chunk was still held
        be.release()
        assert wait_idle(w, timeout=10)  # the prefill went on
        b = be.next_token(int(prompt[-1]))
        (draft,) = w.propose(StepRequest([np.append(prompt, np.int32(b))], [3], 0.05))
        assert draft == be.chain(b, 3) and be.expired == 0
    finally:
        be.release()
        w.close()


def test_a_served_lookup_continuation_is_pre_drafted_from_its_end():
    """The proposer serves the model draft and the lookup folded (serve); the drafter
    pre-drafts from the end of the same, so the step after an accepted lookup finds its
    branch ready."""

    be, d = make(DraftPolicy(k=4, parallel=True, budget=2, multi_sequence=False))
    prompt = ctx(1, 2)
    model = be.chain(2, 2)
    lookup = be.chain(2, 5)  # agrees with the model's draft and goes 3 tokens further
    (draft,) = d.propose(StepRequest([prompt], [4], hints=[hint_of(lookup, 0.9, 0.8, 0.0)]))
    assert draft == model  # the drafter returns its own draft; the proposer combines
    assert list(d.jobs[0].prefix) == [1, 2, *lookup]
    assert d.stats.lookup_predrafts == 1
    d.predraft()
    # the target accepted all five lookup tokens and added its own next one
    nxt = be.next_token(lookup[-1])
    (draft2,) = d.propose(StepRequest([ctx(1, 2, *lookup, nxt)], [4]))
    assert d.stats.predraft_hits == 1 and draft2 == be.chain(nxt, 2)


@pytest.mark.parametrize("lookup,alpha_lookup,threshold,served", [
    ([9, 9, 9], 0.5, 0.0, "model"),  # they part and the model is likelier: its draft
    ([9, 9, 9], 0.99, 0.0, "lookup"),  # they part and the lookup is likelier
    (None, 0.8, 0.95, "model"),  # agreeing tail that does not pay for its verification
])
def test_the_pre_draft_continues_what_the_proposer_serves(lookup, alpha_lookup, threshold,
                                                          served):
    from duo_vllm.control.serving import serve

    be, d = make(DraftPolicy(k=4, parallel=True, budget=2, multi_sequence=False))
    lookup = be.chain(2, 4) if lookup is None else lookup
    hint = hint_of(lookup, 0.9, alpha_lookup, threshold)
    (own,) = d.propose(StepRequest([ctx(1, 2)], [4], hints=[hint]))
    want, source = serve(own, False, hint)
    assert source == served
    assert list(d.jobs[0].prefix) == [1, 2, *want]


def test_pause_drops_the_background_work_and_the_next_step_resumes():
    import time

    be, w = gated_worker(0.01)
    try:
        be.hold()
        long = ctx(*[(3 * i) % 50 for i in range(300)])  # prefilled in 64-token chunks
        w.prefetch([long, ctx(*[(5 * i) % 50 for i in range(300)])])
        assert be.entered.wait(30)  # a chunk under way, held
        started = be.started
        w.pause()  # the gate turned drafting off
        be.release()
        assert wait_idle(w, timeout=10)
        # the chunk under way ended; no decode call followed it
        assert be.started == started and be.expired == 0
        held = max(len(s.tokens) for s in w.drafter.pool.slots)
        time.sleep(0.3)  # a window for background work that should not come
        assert be.started == started
        assert max(len(s.tokens) for s in w.drafter.pool.slots) == held < 300  # idle
        seq = np.append(long, np.int32(be.next_token(int(long[-1]))))
        assert w.propose(StepRequest([seq], [3], 0.05)) == [[]]  # drafting resumes: prefilled again
        assert wait_idle(w, timeout=20)
        seq = np.append(seq, np.int32(be.next_token(int(seq[-1]))))
        assert w.propose(StepRequest([seq], [3], 0.05))[0] == be.chain(int(seq[-1]), 3)
    finally:
        be.release()
        w.close()


def test_a_pause_that_waits_returns_once_the_decode_call_under_way_has_ended():
    be, w = gated_worker(0.01)
    try:
        be.hold()
        w.prefetch([ctx(*[(3 * i) % 50 for i in range(300)])])  # in 64-token chunks
        assert be.entered.wait(30)  # a chunk under way, held
        started, pausing = be.started, threading.Event()
        releaser = threading.Thread(target=lambda: (pausing.wait(30), be.release()),
                                    daemon=True)
        releaser.start()
        pausing.set()  # the chunk is let go as the pause begins
        w.pause(wait=True)  # the target is about to take the draft's core
        be.events.append("pause returned")
        assert be.events == ["decode ended", "pause returned"]  # it waited out the chunk
        releaser.join()
        assert wait_idle(w, timeout=10)
        assert be.started == started and be.expired == 0  # and nothing followed it
    finally:
        be.release()
        w.close()


def test_the_worker_says_when_nothing_runs_in_the_background_during_the_step():
    be, w = slow_worker(0.0)
    try:
        seq = ctx(*range(1, 12))
        drafts = w.propose(StepRequest([seq], [3], 0.05))  # a pre-draft queued for the next step
        assert not getattr(drafts, "idle", False)
        assert wait_idle(w, timeout=5)

        def plan_nothing(*args, **kwargs):  # the controller plans no pre-draft
            w.drafter.jobs = []

        w.drafter._plan_jobs = plan_nothing
        seq = np.append(seq, np.int32(be.next_token(int(seq[-1]))))
        drafts = w.propose(StepRequest([seq], [3], 0.05))
        assert drafts.idle and drafts == [be.chain(int(seq[-1]), 3)]  # served, then idle
        assert w._idle()
        w._prompts = [ctx(*range(30, 90))]  # a prompt queued for the background thread
        assert not w._idle()
        w._prompts, w._stash = [], ("a step's contexts",)  # a step left for it
        assert not w._idle()
        w._stash = None
    finally:
        w.close()


def test_a_window_prefills_only_the_last_tokens_of_a_long_prompt():
    be = FakeBackend()
    d = DuoDrafter(be, max_sequences=2, n_ctx=100, policy=serial(k=3), window=8)
    prompt = np.arange(1, 41, dtype=np.int32)  # 40 tokens
    (draft,) = d.propose(StepRequest([prompt], [3]))
    assert sum(len(toks) for _, toks, _ in be.evaluated) == 8 + 2  # the window, then 2 draft steps
    # its first 2 tokens and its last 6, at draft positions from 0
    assert be.evaluated[0][1:] == (list(prompt[:2]) + list(prompt[-6:]), 0)
    assert draft == be.chain(40, 3)
    be.evaluated.clear()
    # the next step: only the new tokens, after the window
    (draft2,) = d.propose(StepRequest([np.append(prompt, [draft[0], 9])], [3]))
    assert be.evaluated[0][1:] == ([9], 9)  # the window and the accepted draft token are held
    assert draft2 == be.chain(9, 3)


def test_a_window_slides_on_past_the_drafts_context():
    policy = serial(k=3)
    be, d = make(policy, n_ctx=20)
    long = np.arange(1, 31, dtype=np.int32)  # longer than n_ctx
    assert d.propose(StepRequest([long], [3])) == [[]]  # the whole context does not fit: no draft
    be2 = FakeBackend()
    d2 = DuoDrafter(be2, max_sequences=1, n_ctx=20, policy=policy, window=16)
    assert d2.pool.window == 10  # at most half the draft's context
    (draft,) = d2.propose(StepRequest([long], [3]))
    assert draft == be2.chain(30, 3)
    grown = np.concatenate([long, np.arange(31, 38, dtype=np.int32)])  # the window is full
    (draft2,) = d2.propose(StepRequest([grown], [3]))
    assert draft2 == be2.chain(37, 3)
    assert d2.pool.slots[0].offset == len(grown) - 8  # a head of 2, a tail of 8
    assert be2.seqs[0][:10] == list(grown[:2]) + list(grown[-8:])  # evaluated anew


def test_stats_split_vllms_wait_into_the_actors_handling_and_drafting_on_the_spot():
    be, w = slow_worker(0.01, parallel=False)  # serial: every draft is made while vLLM waits
    try:
        seq = [1, 2, 3]
        for _ in range(4):
            (draft,) = w.propose(StepRequest([ctx(*seq)], [3], 0.05))
            assert draft == be.chain(seq[-1], 3)
            seq.append(be.next_token(seq[-1]))
        s = w.stats()
        assert s["sync_calls"] == 4
        # each step evaluates at least its 3 draft tokens on the spot, 10 ms each
        assert s["sync_s"] >= 4 * 3 * 0.01
        # the handler's time per step holds the drafting on the spot
        assert s["actor_propose_ms"] >= 1e3 * s["sync_s"] / 4 > 0
    finally:
        w.close()


class TimedBackend(FakeBackend):
    """A fake draft whose decode calls take ``fixed_s + per_token_s · w`` on ``clock``."""

    def __init__(self, clock, fixed_s=0.008, per_token_s=0.0024):
        super().__init__()
        self.clock, self.fixed_s, self.per_token_s = clock, fixed_s, per_token_s

    def decode(self, items):
        self.clock[0] += self.fixed_s + self.per_token_s * sum(len(t) for _, t, _ in items)
        return super().decode(items)


def test_calibrated_narrow_calls_keep_a_long_prompt_from_locking_the_draft_out(monkeypatch):
    """The first calls measured were one long prompt's 64-token prefill chunks (162 ms):
    a one-token call read off them (half: 81 ms) outlasts a 26 ms target step, no
    pre-draft is planned, and no narrow call ever runs to correct it. Timed at
    start-up, D(1) is what a one-token call costs (10.4 ms): the prompt's catch-up
    goes on and a pre-draft is planned."""
    import duo_vllm.draft.drafter as drafter_mod

    clock = [0.0]
    monkeypatch.setattr(drafter_mod.time, "perf_counter", lambda: clock[0])
    prompt = [(7 * i) % 50 for i in range(150)]

    def first_steps(d):
        assert d.prefetch([ctx(*prompt)]) == 1  # vLLM prefills it: so does the draft
        d.predraft(interrupt=lambda: 64 in d.draft_time.table())  # one chunk, then a step
        return d.propose(StepRequest([ctx(*prompt, 1)], [4], 0.026, per_token_s=0.001))

    be, d = make(auto(), backend=TimedBackend(clock), n_ctx=1000)
    assert first_steps(d) == [[]]
    assert d.draft_time(1) > 0.026 and d.jobs == []  # locked out

    be, d = make(auto(), backend=TimedBackend(clock), n_ctx=1000)
    table = d.calibrate()
    assert table == pytest.approx({w: 0.008 + 0.0024 * w for w in (1, 2, 3, 4)})
    assert be.seqs[0] == [] and d.pool.slots[0].tokens.size == 0  # nothing left behind
    assert first_steps(d) == [[]]  # still catching up: nothing to serve yet
    assert d.draft_time(1) == pytest.approx(0.0104) and len(d.jobs) == 1
    assert d.jobs[0].evals >= 1


def test_a_weak_lookup_tail_is_pre_drafted_from_where_it_parts_from_the_model():
    """A copied tail the target will likely turn down: the pre-draft is rooted where
    the copy leaves the model's own draft, so the target's token there (the model's
    guess), or copied tokens the model's chain also follows and then the target's
    own, find their branch ready."""

    def first_step(lookup, alpha_lookup=0.4):
        be, d = make(DraftPolicy(k=4, parallel=True, budget=3, multi_sequence=False))
        (draft,) = d.propose(StepRequest([ctx(1, 2)], [4],
                                         hints=[hint_of(lookup, 0.9, alpha_lookup, 0.0)]))
        assert draft == be.chain(2, 3) == [17, 22, 7]  # the model's own
        return be, d

    # the copy extends the model's draft with 9, 9, 9: served whole, rooted before the 9s
    be, d = first_step([17, 22, 7, 9, 9, 9])
    assert list(d.jobs[0].prefix) == [1, 2, 17, 22, 7] and d.stats.hedged_roots == 1
    d.predraft()
    # the target accepted 17, 22, 7, turned 9 down and sampled 2, the model's guess
    (draft,) = d.propose(StepRequest([ctx(1, 2, 17, 22, 7, 2)], [4]))
    assert draft == be.chain(2, 3) and d.stats.predraft_hits == 1
    # the copy [.., 2, 9, 9]: the target accepts its 2 too, then samples 17 (the model's)
    be, d = first_step([17, 22, 7, 2, 9, 9])
    d.predraft()
    (draft,) = d.propose(StepRequest([ctx(1, 2, 17, 22, 7, 2, 17)], [4]))
    assert draft == be.chain(17, 2) and d.stats.deep_hits == 1  # the branch's 3rd token on
    # a strong copy is pre-drafted from its end, as before
    be, d = first_step([17, 22, 7, 9, 9, 9], alpha_lookup=0.95)
    assert list(d.jobs[0].prefix) == [1, 2, 17, 22, 7, 9, 9, 9] and d.stats.hedged_roots == 0
    # per-token α of the copy (as the proposer sends them): what counts is the tail's,
    # from where it leaves the model's draft
    be, d = first_step([17, 22, 7, 9, 9, 9], alpha_lookup=(0.1, 0.1, 0.1, 0.95, 0.95, 0.95))
    assert list(d.jobs[0].prefix) == [1, 2, 17, 22, 7, 9, 9, 9] and d.stats.hedged_roots == 0
    be, d = first_step([17, 22, 7, 9, 9, 9], alpha_lookup=(0.95, 0.95, 0.95, 0.4, 0.4, 0.4))
    assert list(d.jobs[0].prefix) == [1, 2, 17, 22, 7] and d.stats.hedged_roots == 1


@pytest.mark.expect_swallowed(RuntimeError, reason="the backend's injected failure")
def test_a_failed_predraft_leaves_no_branch_sequence_holding_cells():
    """A decode that fails while the pre-draft extends its branches (each branch
    sequence already holds its copy of the context): every branch sequence of the
    slot is emptied, so none keeps KV cells until its next use."""
    from duo_vllm.control.goodput import Acceptance

    class FailsOnBranches(FakeBackend):
        def decode(self, items):
            if any(seq >= d.pool.size for seq, _, _ in items):
                raise RuntimeError("boom")
            return super().decode(items)

    be = FailsOnBranches(spread={t: {10: 4.0, 11: 3.9} for t in range(50)})  # unsure
    _, d = make(auto(multi_sequence=True), backend=be)
    d.acceptance = Acceptance(prior={"greedy": 0.6, "sampled": 0.5})
    d.draft_time = FixedDraftTime(0.010)
    d.propose(StepRequest([ctx(1, 2, 9)], [4], 0.05, per_token_s=0.002))
    assert d.jobs
    d.predraft()
    assert d.stats.errors == 1
    assert all(not cells for seq, cells in be.seqs.items() if seq >= d.pool.size)
    assert not be.seqs.get(0)
