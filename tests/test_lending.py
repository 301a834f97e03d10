"""Lending the draft's cores to a CPU target (duo_vllm/host/lending.py; its pure decisions in
duo_vllm/control/lending.py), and the proposer switching the target's threads with the gate.
No vLLM, no model."""

import dataclasses
import inspect
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from duo_vllm.config import DuoConfig
from duo_vllm.control.verdict import LOOKUP, MODEL
from duo_vllm.control.lending import remake_pays
from duo_vllm.host.lending import (ONEDNN_CACHE, MatmulPrimitives, TargetThreads, bind_order,
                                   lend_plan)
from duo_vllm.sources.base import Sources
from duo_vllm.vllm.lender import REMAKE_WEIGHT
from duo_vllm.vllm.model_source import ModelSource
from tests.support.proposer_steps import FakeDraftWorker, bare, inputs, on_mode


def test_bind_order_reads_each_openmp_runtime_in_thread_order():
    assert bind_order({"GOMP_CPU_AFFINITY": "2 0 1"}) == [2, 0, 1]
    assert bind_order({"GOMP_CPU_AFFINITY": "0-3"}) == [0, 1, 2, 3]
    assert bind_order({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[4,5,6]"}) == [4, 5, 6]
    assert bind_order({"OMP_PLACES": "{3},{1}", "OMP_PROC_BIND": "true"}) == [3, 1]
    assert bind_order({"VLLM_CPU_OMP_THREADS_BIND": "0-1"}) == [0, 1]
    # the runtime's own list wins over vLLM's variable (it is what the threads got)
    assert bind_order({"GOMP_CPU_AFFINITY": "1 0", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}) == [1, 0]
    for unknown in ({}, {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
                    {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}, {"GOMP_CPU_AFFINITY": "x"},
                    {"OMP_PLACES": "{0,1}"}):  # one place of two cores: threads float
        assert bind_order(unknown) is None


def test_the_draft_cores_can_be_lent_only_as_the_tail_of_the_binding():
    assert lend_plan([0, 1], [1], 2) == (2, 1)
    assert lend_plan([0, 1, 2, 3], [2, 3], 4) == (4, 2)
    assert lend_plan([0, 1, 2, 3], [3, 2], 4) == (4, 2)  # the tail, in any order
    assert lend_plan([0, 1], [0], 2) is None  # the head: dropping threads frees the tail
    assert lend_plan([0, 1, 2], [1], 3) is None  # in the middle
    assert lend_plan([1], [1], 1) is None  # nothing left for the target
    assert lend_plan([0, 1], [1, 2], 2) is None  # a core the target does not have
    assert lend_plan([0, 1], [1], 1) is None  # the target runs fewer threads than cores
    assert lend_plan(None, [1], 2) is None and lend_plan([0, 1], None, 2) is None


def test_target_threads_switch_only_on_a_change_and_count_the_lent_steps():
    calls = []
    t = TargetThreads((4, 2), setter=calls.append)
    assert t.lent  # the target starts with its whole binding
    assert [t.use(x) for x in (True, False, False, True)] == [False, True, False, True]
    assert calls == [2, 4] and t.switches == 2 and t.lent_steps == 2


def test_the_lend_hook_runs_after_each_switch_to_every_thread_and_only_then():
    events = []
    t = TargetThreads((2, 1), setter=lambda n: events.append(("threads", n)),
                      on_lend=lambda: events.append("lend"))
    for lend in (True, False, False, True, True, False, True):
        t.use(lend)
    assert events == [("threads", 1), ("threads", 2), "lend", ("threads", 1),
                      ("threads", 2), "lend"]


class FakeOps:
    """vLLM's ``_custom_ops`` as the CPU GEMM dispatch calls it, with the C++ handler's
    cache as vLLM-CPU has it: per weight shape (n, k, dtype) an LRU of ``capacity``
    primitives keyed by (rows, row stride after ``reshape``, bias?), each made for the
    thread count of its first call (``threads``)."""

    def __init__(self, capacity=32):
        self.capacity, self.threads = capacity, 1
        self.caches = {}  # (n, k, dtype) -> OrderedDict key -> threads it was made for
        self.calls = []

    def onednn_mm(self, handler, x, bias):
        x2 = x.reshape(-1, handler.k)  # as vllm._custom_ops.onednn_mm does
        key = (x2.shape[0], x2.stride(0), bias is not None)
        cache = self.caches.setdefault((handler.n, handler.k, x.dtype), OrderedDict())
        if key in cache:
            cache.move_to_end(key)
        else:
            cache[key] = self.threads
            while len(cache) > self.capacity:
                cache.popitem(last=False)
        self.calls.append((handler.name, tuple(x.shape), x.stride(0), bias))
        return torch.zeros(x2.shape[0], handler.n, dtype=x.dtype)

    def made_for(self):
        return {t for cache in self.caches.values() for t in cache.values()}


def onednn_layer(ops, name, n, k, dtype=torch.float32):
    """A linear layer as vLLM-CPU's dispatch leaves it (the weight may be emptied)."""
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
    handler = SimpleNamespace(name=name, n=n, k=k)
    layer.cpu_linear = lambda x, weight, bias: ops.onednn_mm(handler, x, bias)
    return layer


def test_a_refresh_leaves_no_primitive_made_for_fewer_threads():
    ops = FakeOps(capacity=4)
    model = torch.nn.ModuleList([
        onednn_layer(ops, "q0", 960, 576), onednn_layer(ops, "o0", 576, 576),
        onednn_layer(ops, "q1", 960, 576),  # the same shape as q0: the same cache
        onednn_layer(ops, "bf", 960, 576, torch.bfloat16),  # another dtype: another cache
        torch.nn.Linear(4, 4)])  # not a oneDNN layer
    model[4].cpu_linear = torch.nn.functional.linear
    prims = MatmulPrimitives(model, capacity=4)
    assert [k for _, k, _ in prims.linears] == [576, 576, 576]
    bias = torch.zeros(960)
    for lend_back in range(2):
        ops.threads = 1  # drafting: the target's steps make primitives for one thread
        for layer in model[:4]:
            for rows in (1, 3, 5):
                x = torch.zeros(rows, 576, dtype=layer.weight.dtype)
                layer.cpu_linear(x, None, None)
                layer.cpu_linear(x, None, bias.to(x.dtype))
            # an input whose row stride is one the refresh uses
            layer.cpu_linear(torch.zeros(2, 577, dtype=layer.weight.dtype)[:, :576], None, None)
        assert 1 in ops.made_for()
        ops.threads = 2  # lent: every thread, then the refresh
        prims.refresh()
        assert ops.made_for() == {2}, ops.caches
        assert prims.refreshes == lend_back + 1
    # one pass per weight shape: the layers of a shape share its cache
    assert {name for name, *_ in ops.calls[-3 * 8:]} == {"q0", "o0", "bf"}


def test_the_caches_are_emptied_only_before_a_lent_step_that_could_reuse_a_one_thread_shape():
    ops = FakeOps(capacity=8)
    model = torch.nn.ModuleList([onednn_layer(ops, "q", 960, 576)])
    prims = MatmulPrimitives(model, capacity=8)

    def step(rows, lent):
        ops.threads = 2 if lent else 1
        remade = prims.before_step(rows, lent)
        model[0].cpu_linear(torch.zeros(rows, 576), None, None)
        return remade

    for rows in (1, 3, 5, 3):  # drafting at batch 1: one thread
        assert not step(rows, lent=False)
    assert not step(4096, lent=True) and not step(16, lent=True)  # a wide batch, lent
    assert not any(made == 1 for key, made in ops.caches[(960, 576, torch.float32)].items()
                   if key[0] in (16, 4096))
    assert prims.refreshes == 0
    assert step(3, lent=True)  # the batch drained to a row count drafting made on one
    assert prims.refreshes == 1 and ops.made_for() == {2}
    assert not step(5, lent=True)  # emptied: nothing on one thread since
    assert prims.refreshes == 1


def test_a_row_count_first_run_lent_or_long_out_of_the_cache_needs_no_refresh():
    ops = FakeOps(capacity=4)
    model = torch.nn.ModuleList([onednn_layer(ops, "q", 960, 576)])
    prims = MatmulPrimitives(model, capacity=4)
    cache = ops.caches.setdefault((960, 576, torch.float32), OrderedDict())

    def step(rows, lent):
        ops.threads = 2 if lent else 1
        remade = prims.before_step(rows, lent)
        model[0].cpu_linear(torch.zeros(rows, 576), None, None)
        return remade

    assert not step(3, lent=True)  # made for every thread
    assert not step(3, lent=False)  # reused on one: still the primitive for two
    assert not prims.needs_refresh(3) and not step(3, lent=True)
    assert not step(5, lent=False)  # made for one thread
    assert prims.needs_refresh(5)
    for rows in (6, 7, 8, 9):  # four newer shapes push it out of the LRU
        assert not step(rows, lent=True)
    assert (5, 576, False) not in cache and not prims.needs_refresh(5)
    assert not step(5, lent=True) and prims.refreshes == 0
    assert cache[(5, 576, False)] == 2  # made anew, for every thread
    # the model and the caches agree: a refresh only where a one-thread primitive is hit
    assert not step(10, lent=False) and step(10, lent=True) and prims.refreshes == 1
    assert ops.made_for() == {2}


def test_where_a_shapes_layers_differ_in_a_bias_the_caches_hold_half_the_row_counts():
    ops = FakeOps(capacity=16)
    qkv = onednn_layer(ops, "qkv", 960, 576)
    qkv.bias = torch.nn.Parameter(torch.zeros(960), requires_grad=False)  # Qwen's qkv
    model = torch.nn.ModuleList([qkv, onednn_layer(ops, "o", 576, 576),
                                 onednn_layer(ops, "q2", 960, 576)])
    prims = MatmulPrimitives(model, capacity=16)
    assert prims.rows_held == 8


def test_one_row_inputs_would_not_evict_them():
    """Why the refresh uses two rows: reshape drops a one-row input's stride."""
    ops = FakeOps(capacity=4)
    layer = onednn_layer(ops, "q", 960, 576)
    layer.cpu_linear(torch.zeros(1, 576), None, None)  # made for 1 thread
    ops.threads = 2
    buf = torch.zeros(576 + 8)
    for s in range(1, 9):
        layer.cpu_linear(buf.as_strided((1, 576), (576 + s, 1)), None, None)
    # all eight hit the first call's key: the primitive made for one thread survives
    assert ops.made_for() == {1} and len(ops.caches[(960, 576, torch.float32)]) == 1


def test_the_eviction_matches_vllms_primitive_cache_size():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers import utils

    source = inspect.getsource(utils.dispatch_cpu_unquantized_gemm)
    assert f"create_onednn_mm(origin_weight.t(), {ONEDNN_CACHE})" in source
    assert "ops.onednn_mm(handler, x, bias)" in source  # what onednn_keys looks for


def lending(worker, runner_ids=("a",)):
    p = bare(worker)
    calls = []
    p._threads = TargetThreads((2, 1), setter=calls.append)
    p.attach_runner(SimpleNamespace(input_batch=SimpleNamespace(
        temperature_cpu=np.zeros(len(runner_ids), dtype=np.float32), req_ids=list(runner_ids))))
    return p, calls


def test_the_target_gets_the_draft_cores_exactly_while_the_draft_model_is_off(clock):
    w = FakeDraftWorker()
    p, calls = lending(w)
    modes = iter([True, True, False, False, True])
    p.verdict.choose = lambda b, sampled, key=None: on_mode(next(modes))
    served = []
    for _ in range(5):
        sampled, n, ids = inputs([[1, 2]])
        served.append(p.propose(sampled, n, ids))
        clock.now += 0.05
    assert calls == [1, 2, 1]  # drafting: 1 thread; off: both; drafting again: 1
    assert len(w.calls) == 3 and served[2] == [[]]  # no draft work while lent
    p.hold()
    sampled, n, ids = inputs([[1, 2]])
    p.propose(sampled, n, ids)
    assert calls[-1] == 2  # held: plain decoding on every core


def test_steps_on_the_lent_cores_are_no_samples_of_the_drafting_step_time(clock):
    w = FakeDraftWorker(drafts=[[]])
    p, _ = lending(w)
    on = {"v": True}
    p.verdict.choose = lambda b, sampled, key=None: on_mode(on["v"])
    sampled, n, ids = inputs([[1, 2]])
    for i in range(20):  # drafting: the target alone on its core, 60 ms a step
        p.propose(sampled, n, ids)
        clock.now += 0.060
    on["v"] = False
    for i in range(20):  # lent: on both cores, 35 ms a step
        p.propose(sampled, n, ids)
        clock.now += 0.035
    assert abs(p.step_time.cost(1).t0 - 0.060) < 2e-3
    assert abs(p.lent_step_time.cost(1).t0 - 0.035) < 2e-3  # the lent steps' own T(B)


@pytest.mark.parametrize("lent_per_token,served", [(0.020, []), (0.0001, [7, 8, 5, 6])])
def test_copies_on_a_lent_step_are_priced_on_what_a_lent_step_costs(clock, lent_per_token,
                                                                    served):
    """A verified token that is nearly free on drafting steps (the target on its own
    core) can cost a lent step much more: at batch 16 one cost a lent step about twice
    what drafting steps at batch 1 extrapolated to, and copies that lost were served."""
    from duo_vllm.sources.lookup import ContextLookup

    w = FakeDraftWorker()
    p, _ = lending(w)
    p.sources = Sources(ModelSource(), [ContextLookup(min_n=2, max_n=4)])
    p.verdict.choose = lambda b, sampled, key=None: LOOKUP  # the draft model off: lent
    for e in range(0, 5):
        p.step_time.observe(1, e, 0.060 + 0.0001 * e)  # drafting steps: nearly free
        p.lent_step_time.observe(1, e, 0.035 + lent_per_token * e)
    sampled, n, ids = inputs([[5, 6, 7, 8, 5, 6]])  # "5 6" came before, then 7 8 5 6
    assert p.propose(sampled, n, ids) == [served]  # a 2-token match's prior α, 0.4
    assert w.calls == [] and p._threads.lent


@pytest.mark.expect_swallowed(RuntimeError, reason="the draft side's injected failure")
def test_a_draft_side_that_failed_lends_its_cores_back(clock):
    class Broken(FakeDraftWorker):
        def propose(self, *a, **k):
            raise RuntimeError("draft died")

    p, calls = lending(Broken())
    sampled, n, ids = inputs([[1, 2]])
    assert p.propose(sampled, n, ids) == [[]]  # drafting: 1 thread, then the side fails
    assert p.propose(sampled, n, ids) == [[]]  # plain decoding for good, on both cores
    assert calls == [1, 2] and p._threads.lent


class IdleWorker(FakeDraftWorker):
    """Drafts ``drafts``; ``idle``: nothing left for its background thread."""

    idle = True

    def prefetch(self, prompts):
        self.prefetched = prompts
        return len(prompts)

    def propose(self, *args, **kwargs):
        from duo_vllm.runtime.delta import Drafts

        out = super().propose(*args, **kwargs)
        return Drafts(out, idle=True) if self.idle else out


class Prefetching(IdleWorker):
    """An :class:`IdleWorker` that counts its pauses."""

    pauses = 0
    prefetched = None

    def pause(self, wait=False):
        self.pauses += 1


def new_prompt(req_id="a", length=20, cached=0):
    """A greedy request vLLM is about to prefill: ``length`` prompt tokens, ``cached`` of
    them in its prefix cache."""
    return SimpleNamespace(prompt_token_ids=list(range(length)), req_id=req_id,
                           num_computed_tokens=cached,
                           sampling_params=SimpleNamespace(temperature=0.0))


def test_a_draft_side_with_nothing_to_run_beside_the_step_lends_its_cores_for_it(clock):
    w = IdleWorker(drafts=[[]])
    p, calls = lending(w)
    p.verdict.choose = lambda b, sampled, key=None: MODEL  # drafting pays at this batch size
    sampled, n, ids = inputs([[1, 2]])
    p.propose(sampled, n, ids)  # nothing served, nothing pre-drafted: lent
    assert calls == [] and p._threads.lent and len(w.calls) == 1
    w.idle = False
    p.propose(sampled, n, ids)  # a pre-draft runs beside the step: the draft's cores
    assert calls == [1] and len(w.calls) == 2
    w.idle = True
    p.propose(sampled, n, ids)  # the draft side asked every step, lent again
    assert calls == [1, 2] and len(w.calls) == 3
    # a partial prefill in the step: its token rows are unknown here, not lent
    w.idle = False
    p.propose(sampled, n, ids)
    sampled, n, ids = inputs([[1, 2, 3], []])
    w.idle = True
    p.propose(sampled, n, ids)
    assert calls == [1, 2, 1] and not p._threads.lent


def test_an_idle_draft_side_lends_only_where_no_matmul_would_need_remaking(clock):
    ops = FakeOps()
    w = IdleWorker(drafts=[[7, 8]])
    p, calls = lending(w)
    p._hooked = True
    ops.threads = 2  # vLLM's worker at load: every thread of the binding
    layer = onednn_layer(ops, "q", 960, 576)
    p.load_model(torch.nn.ModuleList([layer]))
    p.before_step(2)  # a lent step of 2 rows: its matmul made for every thread
    layer.cpu_linear(torch.zeros(2, 576), None, None)
    cache = ops.caches[(960, 576, torch.float32)]
    p.verdict.choose = lambda b, sampled, key=None: MODEL
    p._lend(False)
    ops.threads = 1
    p.before_step(3)  # a drafting step of one request and 2 draft tokens, on one thread
    layer.cpu_linear(torch.zeros(3, 576), None, None)  # its matmul, made on one thread
    sampled, n, ids = inputs([[1, 2]])
    assert p.propose(sampled, n, ids) == [[7, 8]]  # idle, but 3 rows were made on one thread
    assert not p._threads.lent
    w.drafts = [[7]]
    p.before_step(2)  # a drafting step of 2 rows: reuses the one made for every thread
    p.propose(sampled, n, ids)  # 2 rows, made for every thread: lent, nothing remade
    assert p._threads.lent
    p.before_step(2)
    assert p._primitives.refreshes == 0 and p._primitives.made[2] is True
    assert cache[(2, 576, False)] == 2


def test_prompts_the_draft_will_not_draft_for_are_prefilled_on_the_lent_cores(clock):
    class Pausing(FakeDraftWorker):
        pauses = 0

        def pause(self, wait=False):
            self.pauses += 1
            self.waited = wait

        def prefetch(self, prompts):
            raise AssertionError("no draft work where the gate will not draft")

    w = Pausing()
    p, calls = lending(w)
    p._prefetch = True
    p.verdict.choose = lambda b, sampled, key=None: MODEL
    sampled, n, ids = inputs([[1, 2]])
    p.propose(sampled, n, ids)  # drafting at batch 1: one thread
    assert calls == [1]
    p.verdict.peek = lambda b, sampled, key=None: on_mode(b < 4)  # off from batch 4 up
    new = [SimpleNamespace(prompt_token_ids=[1, 2, 3],
                           sampling_params=SimpleNamespace(temperature=0.0))] * 15
    p.on_new_requests(new, batch=16)
    assert calls == [1, 2] and w.pauses == 1  # the prefill of 16 runs on both cores
    assert w.waited  # once the draft's decode call under way had ended


def test_a_burst_above_the_cap_is_prefilled_on_every_core_after_its_first_prompt_alone(
        clock):
    """vLLM's engine often starts a burst's first request alone: its prompt is handed to
    the draft, which gets its core back. The rest of the burst takes the batch above the
    cap: their prompts' step runs on every core, the draft's background work dropped."""
    w = Prefetching(drafts=[[7]])
    w.idle = False
    p, calls = lending(w, runner_ids=("a",))
    p.config = DuoConfig(use_actor=False, max_batch=1)
    p._prefetch, p.max_model_len = True, 2048
    p.verdict.choose = p.verdict.peek = lambda b, sampled, key=None: MODEL

    p.on_new_requests([new_prompt("a")], batch=1)  # the burst's first prompt, alone
    sampled, n, ids = inputs([list(range(21))])
    p.propose(sampled, n, ids)  # handed over: the draft's core back to it
    assert [len(c) for c in w.prefetched] == [21] and calls == [1] and w.pauses == 0
    p.on_new_requests([new_prompt(r) for r in "bcd"], batch=4)  # above the cap
    assert calls == [1, 2] and w.pauses == 1  # every core, the draft's work dropped
    assert [len(c) for c in w.prefetched] == [21]  # and nothing more for the draft


def test_a_lending_target_prefills_every_prompt_on_every_core_and_hands_it_over_after(clock):
    w = Prefetching(drafts=[[7]])
    w.idle = False
    p, calls = lending(w, runner_ids=("a", "b"))
    p._prefetch, p.max_model_len = True, 2048
    p.verdict.choose = p.verdict.peek = lambda b, sampled, key=None: MODEL
    sampled, n, ids = inputs([[1, 2]])
    p.propose(sampled, n, ids)  # drafting: the draft's core is its own
    assert calls == [1] and len(w.calls) == 1

    # short or long, in vLLM's prefix cache or not: every core prefills it, the draft
    # nothing beside it (its background work dropped)
    p.on_new_requests([new_prompt(length=20)], batch=1)
    assert calls == [1, 2] and w.prefetched is None and w.pauses == 1
    # the prompt's step: its context goes to the draft one-way, the step waits for nothing
    sampled, n, ids = inputs([list(range(21))])
    assert p.propose(sampled, n, ids) == [[]]
    assert len(w.calls) == 1 and [len(c) for c in w.prefetched] == [21]
    assert calls == [1, 2, 1]  # the draft's core back to it, to prefill the prompt
    assert p.propose(sampled, n, ids) == [[7]]  # from the next step the draft drafts
    assert len(w.calls) == 2
    # mostly cached: lent all the same
    p.on_new_requests([new_prompt(length=700, cached=640)], batch=1)
    assert calls == [1, 2, 1, 2] and p.stats()["lent_prefills"] == 2
    p.propose(sampled, n, ids)  # its step: handed over, no call
    assert len(w.calls) == 2
    # a step where a new prompt joins a request drafted for: the draft is asked as ever
    p.on_new_requests([new_prompt("b", length=25)], batch=2)
    sampled, n, ids = inputs([[1, 2, 3], list(range(26))])
    w.drafts = [[7], [8]]
    assert p.propose(sampled, n, ids) == [[7], [8]] and len(w.calls) == 3
    # where the verdict will not draft, no hand-over either: plain decoding, lent
    p.verdict.peek = lambda b, sampled, key=None: LOOKUP
    p.on_new_requests([new_prompt(length=50)], batch=1)
    assert p._handoff == set() and p._threads.lent


def test_a_draft_side_that_gave_up_takes_no_prompt_and_the_target_keeps_its_cores(clock):
    class GoneClient:  # the actor client after its last restart failed: plain for good
        disabled, restarts = True, 0
        prefetched = None

        def prefetch(self, contexts):
            self.prefetched = contexts
            return False

        def pause(self, wait_s=0.0):
            return False

        def propose(self, step):
            return None

    p, calls = lending(FakeDraftWorker())
    p._client = client = GoneClient()
    p._prefetch, p.max_model_len = True, 2048
    p.verdict.choose = p.verdict.peek = lambda b, sampled, key=None: MODEL
    p._lend(False)  # the draft had its core when it gave up
    p.on_new_requests([new_prompt()], batch=1)
    assert calls == [1, 2]  # the prompt's step on every core
    sampled, n, ids = inputs([list(range(21))])
    assert p.propose(sampled, n, ids) == [[]]
    # no hand-over: nothing sent, and the next step keeps every core
    assert client.prefetched is None and calls == [1, 2] and p._threads.lent


def test_a_target_that_lends_nothing_has_the_draft_prefill_new_prompts_beside_it(clock):
    class Prefetching(FakeDraftWorker):
        prefetched = None

        def prefetch(self, prompts):
            self.prefetched = prompts
            return len(prompts)

    w = Prefetching(drafts=[[7]])
    p = bare(w)  # no lending (the draft has cores of its own, or a GPU target)
    p.attach_runner(SimpleNamespace(input_batch=SimpleNamespace(
        temperature_cpu=np.zeros(1, dtype=np.float32), req_ids=["a"])))
    p._prefetch, p.max_model_len = True, 2048
    p.verdict.choose = p.verdict.peek = lambda b, sampled, key=None: MODEL
    p.on_new_requests([SimpleNamespace(prompt_token_ids=[1, 2, 3], req_id="a",
                                       sampling_params=SimpleNamespace(temperature=0.0))],
                      batch=1)
    assert [list(c) for c in w.prefetched] == [[1, 2, 3]]
    assert p.stats()["side_prefills"] == 1 and p.stats()["lent_prefills"] == 0
    sampled, n, ids = inputs([[1, 2, 3, 4]])
    assert p.propose(sampled, n, ids) == [[7]]  # its first step is drafted for


@pytest.mark.expect_swallowed(TypeError, reason="vLLM's internals moved: a hook set to None")
def test_a_lending_proposer_remakes_the_targets_matmuls_at_each_lend_and_stops_if_that_fails(
        caplog):
    ops = FakeOps()
    p, calls = lending(FakeDraftWorker())
    p.load_model(torch.nn.ModuleList([onednn_layer(ops, "q", 960, 576)]))
    p._lend(False)
    p._lend(True)
    assert calls == [1, 2] and p.stats()["matmul_remakes"] == 1 and ops.calls
    assert ops.made_for() == {1}  # the eviction at load (FakeOps makes for 1 thread)
    assert not p._primitives.made  # without the step hook every lend refreshes
    # vLLM's internals moved under us: the step goes on, the remaking stops, and says so
    ops.onednn_mm = None
    p._lend(False)
    p._lend(True)
    assert calls == [1, 2, 1, 2] and p._threads.on_lend is None
    assert "remaking the target's oneDNN matmuls failed" in caplog.text
    # a proposer that does not lend never touches the target model
    q = bare(FakeDraftWorker())
    q.load_model(torch.nn.ModuleList([onednn_layer(FakeOps(), "q", 960, 576)]))
    assert q._primitives is None and q.stats()["matmul_remakes"] == 0


@pytest.mark.expect_swallowed(TypeError, reason="vLLM's internals moved: a hook set to None")
def test_with_the_step_hook_a_lending_proposer_remakes_before_the_step_that_needs_it(clock):
    ops = FakeOps()
    p, calls = lending(FakeDraftWorker())
    p._hooked = True
    p.load_model(torch.nn.ModuleList([onednn_layer(ops, "q", 960, 576)]))
    assert p._threads.on_lend is None  # not at each lend
    refreshes = p._primitives.refreshes
    p.before_step(5)  # a lent step of 5 token rows: made for every thread
    p._lend(False)
    p.before_step(5)  # a drafting step of 5 token rows reuses it
    p.before_step(20)  # ... and one of 20 (4 requests, 4 draft tokens each): on one thread
    p._lend(True)
    p.before_step(64)  # lent, a wide step: nothing drafting made
    assert p._primitives.refreshes == refreshes
    clock.now, p._started_at = 1.0, 1.0
    real = p._primitives.refresh

    def slow_refresh():  # 7 ms of remaking, on the proposer's clock
        real()
        clock.now += 0.007

    p._primitives.refresh = slow_refresh
    p.before_step(5)  # lent, a row count made for every thread: nothing to remake
    assert p._primitives.refreshes == refreshes
    p.before_step(20)  # lent, a row count drafting made on one thread: remade first
    assert p._primitives.refreshes == refreshes + 1 and calls == [1, 2]
    assert p._started_at == pytest.approx(1.007)  # no part of the step's time
    p._primitives.before_step = None  # vLLM's internals moved under us: stops, says so
    p.before_step(20)
    assert not p._remaking


def test_a_remake_pays_before_decode_steps_and_before_long_prompts_only():
    # a decode step's row count comes back every step
    assert remake_pays(0, 0.0015, drafting=1, full=2, remake_s=0.4)
    # a prompt of 300 tokens: 0.45 s on one thread, 0.225 s on two; the remake costs 0.4
    assert not remake_pays(300, 0.0015, drafting=1, full=2, remake_s=0.4)
    assert remake_pays(300, 0.0015, drafting=1, full=2, remake_s=0.2)
    assert remake_pays(1000, 0.0015, drafting=1, full=2, remake_s=0.4)
    # the more threads the step keeps without the lend, the less a remake gains
    assert not remake_pays(1000, 0.0015, drafting=7, full=8, remake_s=0.4)


def test_a_lent_prompt_step_that_would_not_repay_a_remake_runs_without_one(clock):
    """A short prompt prefilled on one thread beside the draft, then the same row count
    lent (the next batch's prompt of that length): the remake (0.3-0.5 s) costs more
    than one thread loses on it. A decode step of that row count is remade first."""
    ops = FakeOps()
    p, calls = lending(FakeDraftWorker())
    p._hooked = True
    p.load_model(torch.nn.ModuleList([onednn_layer(ops, "q", 960, 576)]))
    refreshes = p._primitives.refreshes
    p._lend(False)
    p.before_step(40, prefill=39)  # a 40-token prompt beside the draft: one thread
    p._lend(True)
    clock.now = 1.0
    real = p._primitives.refresh

    def slow_refresh():  # 0.3 s of remaking, on the proposer's clock
        real()
        clock.now += 0.3

    p._primitives.refresh = slow_refresh
    p.before_step(40, prefill=39)  # lent, 40 rows of a prompt: not worth 0.4 s
    assert p._primitives.refreshes == refreshes and p.stats()["matmul_remakes_skipped"] == 1
    p.before_step(40)  # lent, a decode step of 40 rows (it comes back): remade
    assert p._primitives.refreshes == refreshes + 1
    assert p._remake_s == pytest.approx(0.4 + REMAKE_WEIGHT * (0.3 - 0.4))  # measured


def test_the_remake_is_no_part_of_the_next_steps_time_for_the_gates(clock):
    ops = FakeOps()
    p, _ = lending(FakeDraftWorker())
    p.load_model(torch.nn.ModuleList([onednn_layer(ops, "q", 960, 576)]))
    real = p._primitives.refresh

    def slow_refresh():  # 7 ms of remaking, on the proposer's clock
        real()
        clock.now += 0.007

    p._primitives.refresh = slow_refresh
    p._lend(False)
    clock.now, p._started_at = 1.0, 1.0  # the step under way started at 1.0
    p._lend(True)
    assert clock.now == pytest.approx(1.007) and p._started_at == pytest.approx(1.007)


def test_a_step_of_seeded_sampled_requests_only_lends_and_asks_the_draft_nothing(clock):
    # they decode without drafts (tests/test_proposer_steps.py): no prompt to prefetch,
    # no call, and the draft's cores go to the target, its background work dropped first
    class Pausing(FakeDraftWorker):
        pauses = 0

        def pause(self, wait=False):
            self.pauses += 1

        def prefetch(self, prompts):
            raise AssertionError("a seeded request's prompt was sent to the draft")

    w = Pausing()
    p, calls = lending(w)
    p._gated, p._prefetch = False, True
    p._runner.input_batch.temperature_cpu[0] = 0.7
    sampled, n, ids = inputs([[1, 2]])
    assert p.propose(sampled, n, ids) == [[1, 2, 3, 4]]  # unseeded: drafted
    assert calls == [1] and len(w.calls) == 1  # on the draft's own core
    p._runner.input_batch.generators = {0: torch.Generator()}
    p._runner.requests = {"a": SimpleNamespace(sampling_params=SimpleNamespace(
        temperature=0.7, seed=3))}
    p.on_new_requests([SimpleNamespace(prompt_token_ids=[1, 2, 3], sampling_params=SimpleNamespace(
        temperature=0.7, seed=3))], batch=1)
    assert calls == [1] and w.pauses == 0
    assert p.propose(sampled, n, ids) == [[]] and len(w.calls) == 1
    assert calls == [1, 2] and w.pauses == 1
