"""DuoProposer's step logic with a fake draft worker: no model, no vLLM, no Ray."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from duo_vllm.vllm import draft_side as draft_side_mod
from duo_vllm.config import DuoConfig
from duo_vllm.vllm.rows import valid_prefix
from duo_vllm.control.verdict import LOOKUP, MODEL, PLAIN
from duo_vllm.sources.base import Sources
from duo_vllm.vllm.model_source import ModelSource
from tests.support.proposer_steps import FakeDraftWorker, bare, inputs, on_mode


def test_temperatures_come_from_the_runners_input_batch(clock):
    w = FakeDraftWorker()
    p = bare(w)
    runner = SimpleNamespace(input_batch=SimpleNamespace(
        temperature_cpu=np.array([0.0, 0.7, 1.0], dtype=np.float32)))
    p.attach_runner(runner)
    sampled, n, ids = inputs([[1, 2], [], [3, 4, 5]])
    p.propose(sampled, n, ids)
    assert w.calls[0]["temps"] == [0.0, pytest.approx(1.0)]  # rows 0 and 2 (row 1 prefills)


def test_each_rows_tokens_left_come_from_vllms_request_states(clock):
    w = FakeDraftWorker()
    p = bare(w)

    def state(prompt, max_tokens):
        return SimpleNamespace(num_prompt_tokens=prompt,
                               sampling_params=SimpleNamespace(max_tokens=max_tokens))

    p.attach_runner(SimpleNamespace(
        input_batch=SimpleNamespace(temperature_cpu=np.zeros(3, dtype=np.float32),
                                    req_ids=["a", "b", "c"]),
        requests={"a": state(2, 16), "c": state(1, 2)}))
    sampled, n, ids = inputs([[1, 2, 3], [4, 5], [6, 7, 8]])
    p.propose(sampled, n, ids)
    # a: 1 of 16 generated; b: no state; c: 2 of 2 generated
    assert w.calls[0]["remaining"] == [15, None, 0]
    p.attach_runner(SimpleNamespace(input_batch=SimpleNamespace(
        temperature_cpu=np.zeros(3, dtype=np.float32))))
    p.propose(sampled, n, ids)
    assert w.calls[1]["remaining"] is None  # no request states: unknown


def test_step_time_is_measured_per_batch_and_drafted_tokens(clock):
    w = FakeDraftWorker()
    p = bare(w)
    sampled, n, ids = inputs([[1, 2]])
    for i in range(30):
        w.drafts = [[1, 2, 3, 4]] if i % 2 else [[]]  # the drafts handed to vLLM vary
        p.propose(sampled, n, ids)
        clock.now += 0.050 + 0.005 * len(w.drafts[0])  # the step that verifies them
    cost = p.step_time.cost(1)
    assert cost.t0 == pytest.approx(0.050, abs=1e-3)
    assert cost.per_token == pytest.approx(0.005, abs=2e-4)
    # the worker is handed T₀(B) and c of the batch
    assert w.calls[-1]["step_s"] == pytest.approx(cost.t0, rel=0.05)
    assert w.calls[-1]["per_token_s"] == pytest.approx(cost.per_token, rel=0.05)


def test_prefill_steps_are_not_samples_of_the_step_time(clock):
    p = bare(FakeDraftWorker())
    sampled, n, ids = inputs([[1, 2]])
    p.propose(sampled, n, ids)
    clock.now += 0.05
    p.propose(sampled, n, ids)
    clock.now += 5.0  # a step that also prefilled a new prompt
    p.on_new_requests([])
    p.propose(sampled, n, ids)
    assert p.step_time.predict(1, 4) < 0.1


def test_a_fit_thrown_by_disturbed_steps_recovers_from_the_steps_after_them(clock):
    """CI saw drafting stop for good: a few disturbed deep-draft steps put T₀ at 0.1 ms,
    no draft paid, and every plain step after was refused as idle time (> 3x the
    prediction), so nothing corrected the fit. Now the plain steps after such a burst
    are samples, and the fit comes back to them. A batch size first seen after a
    wider one is predicted off that one's fit, far too short: a step there is idle
    only if far longer than the nearest batch size's steps too."""
    w = FakeDraftWorker(drafts=[[]])
    p = bare(w)
    for _ in range(10):
        p.step_time.observe(1, 1, 0.030)
        p.step_time.observe(1, 4, 0.200)  # disturbed
    sampled, n, ids = inputs([[1, 2]])
    for _ in range(150):  # steps without drafts, 35 ms each
        p.propose(sampled, n, ids)
        clock.now += 0.035
    cost = p.step_time.cost(1)
    assert 0.030 < cost.t0 < 0.045 and cost.per_token < cost.t0 / 2
    clock.now += 5.0  # a real idle gap is still no sample
    p.propose(sampled, n, ids)
    assert p.step_time.mean(1) < 0.050
    # batch 1 first seen after batch 4: predicted from batch 4's fit, 13 ms
    p = bare(FakeDraftWorker(drafts=[[]]))
    for i in range(40):
        p.step_time.observe(4, i % 5 * 4, 0.040 + 0.009 * (i % 5 * 4))
    assert p.step_time.predict(1, 0) < 0.040 / 3
    for _ in range(3):
        p.propose(sampled, n, ids)
        clock.now += 0.040
    assert p.step_time.batch_sizes() == [1, 4]


@pytest.mark.expect_swallowed(IndexError, TypeError, reason='a token table that is None')
def test_propose_never_raises_and_counts_the_failure(clock, caplog):
    p = bare(FakeDraftWorker())
    sampled, n, _ = inputs([[1, 2]])
    assert p.propose(sampled, n, None) == [[]]  # a broken token table
    assert p._errors == 1 and "propose() failed" in caplog.text
    sampled, n, ids = inputs([[1, 2]])
    assert p.propose(sampled, n, torch.from_numpy(ids)) == [[1, 2, 3, 4]]  # a tensor is fine


def test_a_draft_is_cut_at_its_first_invalid_token(clock):
    p = bare(FakeDraftWorker(drafts=[[1, 2, 99, 3]]), vocab=50)
    sampled, n, ids = inputs([[1, 2]])
    assert p.propose(sampled, n, ids) == [[1, 2]]
    assert valid_prefix([5, -1, 6], 50) == [5]
    assert valid_prefix([], 50) == []


def test_gate_off_means_no_call_to_the_draft_side(clock):
    w = FakeDraftWorker()
    p = bare(w)
    ids_batch = SimpleNamespace(temperature_cpu=np.zeros(2, dtype=np.float32), req_ids=["a", "b"])
    p.attach_runner(SimpleNamespace(input_batch=ids_batch))
    p.verdict.choose = lambda batch, sampled, key=None: LOOKUP  # plain decoding measured faster
    sampled, n, ids = inputs([[1, 2], [3, 4]])
    assert p.propose(sampled, n, ids) == [[], []]
    assert w.calls == []
    p.on_new_requests([SimpleNamespace(prompt_token_ids=[1, 2, 3])])  # no prefill either


def test_the_gate_sees_the_tokens_each_step_produced(clock):
    w = FakeDraftWorker(drafts=[[]])
    p = bare(w)
    batch = SimpleNamespace(temperature_cpu=np.zeros(1, dtype=np.float32), req_ids=["a"])
    p.attach_runner(SimpleNamespace(input_batch=batch))
    seen, told = [], []
    p.verdict.observe = lambda b, mode, tokens, seconds, sampled: seen.append(
        (b, mode, tokens, seconds))
    p.verdict.choose = lambda b, sampled, key=None: told.append(key) or MODEL
    ctx = [1, 2]
    for _ in range(3):
        sampled, n, ids = inputs([ctx])
        p.propose(sampled, n, ids)
        clock.now += 0.1
        ctx = ctx + [7, 7, 7]  # three tokens per step (two accepted + one sampled)
    # the verdict knows each step's request before it chooses (at batch 1 a verdict
    # against the model holds for one request)
    assert seen == [(1, MODEL, 3, pytest.approx(0.1))] * 2
    assert told == ["a"] * 3


def test_without_the_gate_or_with_a_fixed_budget_every_step_drafts(clock):
    for cfg in (DuoConfig(use_actor=False, gate=False), DuoConfig(use_actor=False, budget=2)):
        w = FakeDraftWorker()
        p = bare(w)
        p.config = cfg
        p._init_step_state()
        p.attach_runner(SimpleNamespace(input_batch=SimpleNamespace(
            temperature_cpu=np.zeros(1, dtype=np.float32), req_ids=["a"])))
        p.verdict.choose = lambda batch, sampled, key=None: LOOKUP
        sampled, n, ids = inputs([[1, 2]])
        assert p.propose(sampled, n, ids) == [[1, 2, 3, 4]]


def test_lookup_drafts_are_served_when_the_draft_model_is_off_and_scored_per_source(clock):
    from duo_vllm.sources.lookup import LOOKUP, ContextLookup

    w = FakeDraftWorker()
    p = bare(w, k=2)
    p.k_lookup = 4
    p.sources = Sources(ModelSource(), [ContextLookup(min_n=2, max_n=4)])
    p._gated = False
    p._mode, p._on = LOOKUP, False  # the verdict keeps the draft model off
    for e in range(0, 5):  # verifying a token is nearly free: all four pay
        p.step_time.observe(1, e, 0.050 + 0.0001 * e)
    ctx = [5, 6, 7, 8, 9, 10, 5, 6]  # "5 6" came before, followed by 7 8 9 10
    sampled, n, ids = inputs([ctx])
    drafts = p.propose(sampled, n, ids)
    assert w.calls == []  # no draft-model work
    assert drafts == [[7, 8, 9, 10]]  # k_lookup, beyond the model's k
    # the target accepted 7 8, then said 11: lookup judged on 3 tokens, 2 accepted
    sampled, n, ids = inputs([ctx + [7, 8, 11]])
    p.propose(sampled, n, ids)
    s = p._local_stats()
    assert s["lookup_tokens_served"] == 4 and s["lookup_tokens_accepted"] == 2
    key = ("row", 0)  # no runner attached: rows are the keys
    assert p.sources.model.alpha(key, "greedy") == pytest.approx(0.7)  # untouched
    assert p.sources.by_name[LOOKUP].alpha(key, "greedy", 2) > 0.4  # 2 of 3 accepted, after "5 6"


def test_lookup_and_model_drafts_are_combined_by_agreement(clock):
    from duo_vllm.control.serving import serve
    from duo_vllm.sources.lookup import ContextLookup

    w = FakeDraftWorker(drafts=[[7, 8]])  # the model agrees with the lookup's start
    p = bare(w, k=2)
    p.k_lookup = 4
    p.sources = Sources(ModelSource(), [ContextLookup(min_n=2, max_n=4)])
    p._gated = False
    for e in range(0, 5):
        p.step_time.observe(1, e, 0.050 + 0.0001 * e)
    sampled, n, ids = inputs([[5, 6, 7, 8, 9, 10, 5, 6]])
    assert p.propose(sampled, n, ids) == [[7, 8, 9, 10]]  # the longer of two that agree
    # the drafter is told the lookup and serve()'s inputs: it pre-drafts from the same end
    (hint,) = w.calls[-1]["hints"]
    (lookup,) = hint.proposals
    assert lookup.tokens == [7, 8, 9, 10]
    assert serve([7, 8], False, hint)[0] == [7, 8, 9, 10]
    w.drafts = [[3, 4]]  # the model disagrees: the source more likely accepted wins
    # the target said 11: both drafts rejected at once; the lookup's prior was lower
    sampled, n, ids = inputs([[5, 6, 7, 8, 9, 10, 5, 6, 11, 5, 6]])
    assert p.propose(sampled, n, ids) == [[3, 4]]  # model 0.7 → 0.45 > lookup 0.4 → 0.26


def test_lookup_tokens_that_do_not_pay_are_not_served(clock):
    from duo_vllm.sources.lookup import LOOKUP, ContextLookup

    w = FakeDraftWorker()
    p = bare(w, k=2)
    p.sources = Sources(ModelSource(), [ContextLookup(min_n=2, max_n=4)])
    p._gated, p._on = False, False
    for e in range(0, 5):  # verifying a token costs a tenth of a plain step
        p.step_time.observe(1, e, 0.050 + 0.005 * e)
    sampled, n, ids = inputs([[5, 6, 7, 8, 5, 6]])
    assert p.propose(sampled, n, ids) == [[7, 8]]  # the prior (0.4) pays for two
    for _ in range(20):
        # never accepted after a 2-token match
        p.sources.by_name[LOOKUP].acceptance.observe(("row", 0), "greedy", 2, 0, 1)
    sampled, n, ids = inputs([[5, 6, 7, 8, 5, 6, 9, 5, 6]])
    assert p.propose(sampled, n, ids) == [[]]


def test_a_weak_match_that_does_not_pay_leaves_a_long_one_served(clock):
    """Lookup acceptance is kept per match length: short matches that were never
    accepted are no longer served, while a long match of the same request is."""
    from duo_vllm.sources.lookup import LOOKUP, ContextLookup

    w = FakeDraftWorker()
    p = bare(w, k=2)
    p.k_lookup = 4
    p.sources = Sources(ModelSource(), [ContextLookup(min_n=2, max_n=8)])
    p._gated, p._on = False, False
    for e in range(0, 5):  # verifying a token costs a tenth of a plain step
        p.step_time.observe(1, e, 0.050 + 0.005 * e)
    for _ in range(20):
        p.sources.by_name[LOOKUP].acceptance.observe(("row", 0), "greedy", 2, 0, 1)  # never accepted
    sampled, n, ids = inputs([[5, 6, 7, 8, 1, 5, 6]])  # "5 6": a 2-token match
    assert p.propose(sampled, n, ids) == [[]]
    long_ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 1, 2, 3, 4, 5, 6]  # a 6-token match
    sampled, n, ids = inputs([long_ctx])
    assert p.propose(sampled, n, ids) == [[7, 8, 9, 9]]


class PausingWorker(FakeDraftWorker):
    def __init__(self):
        super().__init__()
        self.pauses, self.prefetched = 0, []

    def pause(self, wait=False):
        self.pauses += 1

    def prefetch(self, prompts):
        self.prefetched.append([len(p) for p in prompts])


def test_the_gate_turning_drafting_off_pauses_the_draft_side_and_prompts_follow_the_gate(clock):
    w = PausingWorker()
    p = bare(w)
    p._prefetch = True  # the new-request hook is installed
    batch = SimpleNamespace(temperature_cpu=np.zeros(2, dtype=np.float32), req_ids=["a", "b"])
    p.attach_runner(SimpleNamespace(input_batch=batch))
    modes = iter([True, False, False, True])
    p.verdict.choose = lambda b, sampled, key=None: on_mode(next(modes))
    for _ in range(4):
        sampled, n, ids = inputs([[1, 2], [3, 4]])
        p.propose(sampled, n, ids)
    assert w.pauses == 1  # once, when drafting went off
    new = [SimpleNamespace(prompt_token_ids=[1, 2, 3],
                           sampling_params=SimpleNamespace(temperature=0.0))]
    asked = []
    p.verdict.peek = lambda b, sampled, key=None: on_mode(asked.append((b, sampled, key)) or b < 3)
    p.on_new_requests(new, batch=1)  # the scheduler's count: one request, where it drafts
    assert w.prefetched == [[3]] and asked[-1] == (1, False, None)
    new[0].req_id = "c"  # vLLM names it: at batch 1 the gate is asked for that request
    w.prefetched.clear()
    p.on_new_requests(new, batch=1)
    assert asked[-1] == (1, False, "c")
    w.prefetched.clear()
    p.on_new_requests(new)  # no count: two running + one new, 3 requests: the gate is off
    assert w.prefetched == [] and asked[-1] == (3, False, None)
    p._last_step = (1, 0)  # one running request: 2 with the new one, where the gate drafts
    p.on_new_requests(new)
    assert w.prefetched == [[3]]
    p.on_new_requests([SimpleNamespace(prompt_token_ids=[5, 6],
                                       sampling_params=SimpleNamespace(temperature=0.7))])
    assert asked[-1] == (2, True, None)  # a sampled newcomer makes the batch a sampled one


def test_held_drafting_is_plain_decoding_with_an_idle_draft_side_and_resumes(clock):
    w = PausingWorker()
    p = bare(w)
    p._prefetch = True
    batch = SimpleNamespace(temperature_cpu=np.zeros(1, dtype=np.float32), req_ids=["a"])
    p.attach_runner(SimpleNamespace(input_batch=batch))
    for step in range(2):
        clock.now += 0.05
        sampled, n, ids = inputs([[1, 2]])
        assert p.propose(sampled, n, ids) == [[1, 2, 3, 4]] and len(w.calls) == step + 1
    p.hold()
    assert w.pauses == 1  # the draft side drops its background work at once
    for _ in range(3):
        clock.now += 0.05
        sampled, n, ids = inputs([[1, 2]])
        assert p.propose(sampled, n, ids) == [[]]
    p.on_new_requests([SimpleNamespace(prompt_token_ids=[1, 2, 3],
                                       sampling_params=SimpleNamespace(temperature=0.0))])
    assert len(w.calls) == 2 and w.prefetched == []  # no draft work while held
    p.hold(False)
    clock.now += 0.05
    sampled, n, ids = inputs([[1, 2]])
    assert p.propose(sampled, n, ids) == [[1, 2, 3, 4]] and len(w.calls) == 3


def test_the_verdict_s_modes_serve_lookups_or_nothing_and_each_sample_names_its_mode(clock):
    from duo_vllm.sources.lookup import ContextLookup

    w = FakeDraftWorker()
    p = bare(w, k=2)
    p.k_lookup = 4
    p.sources = Sources(ModelSource(), [ContextLookup(min_n=2, max_n=4)])
    p.attach_runner(SimpleNamespace(input_batch=SimpleNamespace(
        temperature_cpu=np.zeros(1, dtype=np.float32), req_ids=["a"])))
    for e in range(0, 5):  # verifying a token is nearly free: a lookup token pays
        p.step_time.observe(1, e, 0.050 + 0.0001 * e)
    modes, asked, seen = iter([LOOKUP, PLAIN, LOOKUP]), [], []
    p.verdict.choose = lambda b, sampled, key=None: (asked.append(key), next(modes))[1]
    p.verdict.observe = lambda b, mode, tokens, s, sampled: seen.append((mode, tokens))
    ctx = [5, 6, 7, 8, 9, 10, 5, 6]  # "5 6" came before, followed by 7 8 9 10
    sampled, n, ids = inputs([ctx])
    assert p.propose(sampled, n, ids) == [[7, 8, 9, 10]]  # lookups
    clock.now += 0.1
    ctx = ctx + [7, 8, 11]  # two accepted and the target's own
    sampled, n, ids = inputs([ctx])
    p.sources.observe = lambda *a: pytest.fail("plain decoding reads no context")
    assert p.propose(sampled, n, ids) == [[]]  # plain decoding: not even a lookup
    del p.sources.observe
    clock.now += 0.1
    sampled, n, ids = inputs([ctx + [4]])
    p.propose(sampled, n, ids)
    # the copy served before the plain step is scored once lookups run again
    assert p.sources.summary()["lookup_tokens_accepted"] == 2
    assert w.calls == []  # never the draft model
    assert seen == [(LOOKUP, 3), (PLAIN, 1)]  # each step's sample, in the mode it ran
    assert asked == ["a"] * 3  # batch 1: the verdict is told the request


def test_above_max_batch_a_step_does_no_draft_work_at_all(clock):
    from duo_vllm.sources.lookup import ContextLookup

    w = PausingWorker()
    p = bare(w)
    p.config = DuoConfig(use_actor=False, max_batch=1)
    p._init_step_state()
    p._prefetch = True
    p.sources = Sources(ModelSource(), [ContextLookup(min_n=2, max_n=4)])
    p.attach_runner(SimpleNamespace(input_batch=SimpleNamespace(
        temperature_cpu=np.zeros(2, dtype=np.float32), req_ids=["a", "b"])))
    p.verdict.choose = lambda *a, **k: pytest.fail("the verdict is asked above the cap")
    p.sources.observe = lambda *a: pytest.fail("lookups are scored above the cap")
    ctx = [5, 6, 7, 8, 9, 10, 5, 6]
    for _ in range(3):
        sampled, n, ids = inputs([ctx, ctx])
        assert p.propose(sampled, n, ids) == [[], []]
        clock.now += 0.1
    # a request still prefilling (no sampled token yet) counts towards the batch too
    sampled, n, ids = inputs([ctx, []])
    assert p.propose(sampled, n, ids) == [[], []]
    p.on_new_requests([SimpleNamespace(prompt_token_ids=[1, 2, 3])], batch=3)
    assert w.calls == [] and w.prefetched == [] and w.pauses == 1  # one pause, at the cap
    assert p.stats()["capped_steps"] == 4 and p._errors == 0
    del p.verdict.choose, p.sources.observe  # back under the cap: drafting resumes
    p.attach_runner(SimpleNamespace(input_batch=SimpleNamespace(
        temperature_cpu=np.zeros(1, dtype=np.float32), req_ids=["a"])))
    sampled, n, ids = inputs([ctx])
    p.propose(sampled, n, ids)
    assert len(w.calls) == 1 and p._errors == 0


def test_drawn_drafts_go_to_vllm_with_their_q_and_other_drafts_one_hot(clock):
    from duo_vllm.runtime.delta import Drafts

    q = [(np.array([3, 9], dtype=np.int32), np.array([0.6, 0.4], dtype=np.float32))] * 2
    w = FakeDraftWorker(drafts=Drafts([[1, 2], [], [3, 3]], q=[None, None, q]))
    p = bare(w, vocab=12, k=2)
    p._gated = False
    sampled, n, ids = inputs([[1, 2], [6, 7], [4, 5]])
    assert p.propose(sampled, n, ids) == [[1, 2], [], [3, 3]]
    probs = p.take_last_draft_probs()
    assert p.draft_prob_rows == [0, 2]  # the rows with a draft, those only
    assert tuple(probs.shape) == (2, 2, 12)
    assert probs[0, 0, 1] == 1 and probs[0, 1, 2] == 1 and probs[0].sum() == 2  # one-hot
    assert probs[1, 0, 3] == pytest.approx(0.6) and probs[1, 1, 9] == pytest.approx(0.4)
    assert p.take_last_draft_probs() is None  # read once
    assert p.stats()["drawn_tokens"] == 2
    w.drafts = [[1, 2], [], [3, 3]]  # nothing drawn: vLLM verifies as without q
    p.propose(sampled, n, ids)
    assert p.take_last_draft_probs() is None


def test_a_lending_target_carries_no_gate_win_to_a_larger_batch(monkeypatch):
    p = bare(FakeDraftWorker())
    assert p.verdict.reach == 2
    monkeypatch.setattr(draft_side_mod, "resolve_draft_cores", lambda cfg, **_: ([1], True))
    monkeypatch.setattr(draft_side_mod, "lend_plan", lambda order, cores, n: (2, 1))
    assert p._draft_cores(DuoConfig(use_actor=False)) == [1]
    assert p._threads is not None and p.verdict.reach == 0


def test_requests_with_structured_output_are_drafted_without_draws(clock):
    # vLLM's scheduler cuts their drafts at the first token the grammar rejects: a cut by a
    # drawn token's value would bias the output, so they get the argmax (no q)
    w = FakeDraftWorker()
    p = bare(w)
    p.config = DuoConfig(use_actor=False, sampled_drafts=True)
    grammar = SimpleNamespace(structured_outputs=object())
    free = SimpleNamespace(structured_outputs=None)
    p.attach_runner(SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=["a", "b", "c"],
                                    temperature_cpu=np.array([0.7, 0.7, 0.0], dtype=np.float32)),
        requests={"a": SimpleNamespace(sampling_params=grammar),
                  "b": SimpleNamespace(sampling_params=free),
                  "c": SimpleNamespace(sampling_params=free)}))
    p._gated = False
    sampled, n, ids = inputs([[1, 2], [3, 4], [5, 6]])
    p.propose(sampled, n, ids)
    assert w.calls[-1]["temps"] == [0.0, pytest.approx(0.7), 0.0]
    assert p._sampled  # the gate still counts the step as sampled


def test_seeded_sampled_requests_decode_without_drafts(clock):
    # vLLM's rejection sampler draws from a seeded request's generator once per draft
    # token, and how many a step drafts depends on timing: a seeded sampled request gets
    # none, so its seed gives the same tokens every run (those of plain vLLM)
    w = FakeDraftWorker()
    p = bare(w)
    p._gated = False
    gen = torch.Generator()
    batch = SimpleNamespace(req_ids=["a", "b", "c"], generators={1: gen, 2: gen},
                            temperature_cpu=np.array([0.7, 0.7, 0.0], dtype=np.float32))
    params = {r: SimpleNamespace(temperature=float(t), seed=seed)
              for r, t, seed in zip(batch.req_ids, batch.temperature_cpu, (None, 1, 2))}
    p.attach_runner(SimpleNamespace(input_batch=batch, requests={
        r: SimpleNamespace(sampling_params=sp) for r, sp in params.items()}))
    sampled, n, ids = inputs([[1, 2], [3, 4, 5], [6, 7]])
    drafts = p.propose(sampled, n, ids)
    # b samples with a seed: not drafted, not even sent; c's seed draws nothing (greedy)
    assert w.calls[-1]["contexts"] == [[1, 2], [6, 7]]
    assert drafts[1] == [] and drafts[0] and drafts[2]
    assert p.stats()["seeded_rows"] == 1
    assert p._last_step[0] == 3  # the step's T(B) and the gate's batch count every row
    asked = []
    p._gated, p.verdict.choose = True, lambda b, sampled, key=None: asked.append(b) or MODEL
    p.propose(sampled, n, ids)
    assert asked == [3]
    p._gated = False
    batch.temperature_cpu[2] = params["c"].temperature = 0.9  # both seeded rows sample
    drafts = p.propose(sampled, n, ids)
    assert w.calls[-1]["contexts"] == [[1, 2]] and drafts[1] == drafts[2] == []
    p.config = DuoConfig(use_actor=False, draft_seeded=True)  # drafted like the others
    drafts = p.propose(sampled, n, ids)
    assert len(w.calls[-1]["contexts"]) == 3 and all(drafts)
