"""Contexts sent as deltas (duo_vllm/runtime/delta.py): the draft side keeps each request's context.

Fakes only: no model, no vLLM, no Ray.
"""

import pickle

import numpy as np
import pytest

from duo_vllm.config import DuoConfig
from duo_vllm.runtime.delta import Delta, DeltaReceiver, DeltaSender, Drafts
from duo_vllm.vllm.proposer import DuoProposer
from duo_vllm.runtime.message import StepRequest
from tests.support.fakes import FakeBackend, wait_idle


def grow(rng, contexts, lo=1, hi=4):
    return {k: np.concatenate([c, rng.integers(0, 50, rng.integers(lo, hi + 1))]).astype(np.int32)
            for k, c in contexts.items()}


def step(sender, receiver, contexts: dict):
    """One step: encode, decode; returns (delta, decoded contexts, resend)."""
    keys = list(contexts)
    delta = sender.encode(keys, [contexts[k] for k in keys])
    full, resend = receiver.decode(delta)
    sender.forget(resend)
    return delta, dict(zip(keys, full)), resend


def assert_same(decoded: dict, contexts: dict):
    assert decoded.keys() == contexts.keys()
    for k, c in contexts.items():
        assert decoded[k] is not None and decoded[k].dtype == np.int32
        np.testing.assert_array_equal(decoded[k], c)


def test_round_trip_over_growing_contexts_sends_only_new_tokens():
    rng = np.random.default_rng(0)
    sender, receiver = DeltaSender(), DeltaReceiver()
    contexts = {f"req-{i}": rng.integers(0, 50, 100 + 30 * i).astype(np.int32) for i in range(4)}
    delta, decoded, resend = step(sender, receiver, contexts)
    assert delta.starts == [0] * 4 and not resend  # the first step: in full
    assert_same(decoded, contexts)
    for _ in range(50):  # past several buffer growths
        old = {k: len(c) for k, c in contexts.items()}
        contexts = grow(rng, contexts)
        delta, decoded, resend = step(sender, receiver, contexts)
        assert not resend
        assert delta.starts == [old[k] for k in contexts]  # the rest is held over there
        assert delta.lengths == [len(c) - old[k] for k, c in contexts.items()]
        assert_same(decoded, contexts)


def test_contexts_handed_out_never_change_afterwards():
    sender, receiver = DeltaSender(), DeltaReceiver()
    first = np.arange(60, dtype=np.int32)
    _, decoded, _ = step(sender, receiver, {"a": first})
    held = decoded["a"]  # the drafter keeps contexts (slot.tokens, a stash)
    assert not held.flags.writeable
    _, _, _ = step(sender, receiver, {"a": np.append(first, np.int32(99))})
    _, _, _ = step(sender, receiver, {"a": np.arange(7, 17, dtype=np.int32)})  # rewritten
    np.testing.assert_array_equal(held, np.arange(60))


def test_a_new_key_is_sent_in_full_and_the_others_as_deltas():
    sender, receiver = DeltaSender(), DeltaReceiver()
    contexts = {"a": np.arange(20, dtype=np.int32)}
    step(sender, receiver, contexts)
    contexts = {"a": np.arange(22, dtype=np.int32), "b": np.arange(5, 40, dtype=np.int32)}
    delta, decoded, _ = step(sender, receiver, contexts)
    assert delta.starts == [20, 0] and delta.lengths == [2, 35]
    assert_same(decoded, contexts)


def test_a_finished_key_is_forgotten_on_both_sides():
    sender, receiver = DeltaSender(), DeltaReceiver()
    a, b = np.arange(30, dtype=np.int32), np.arange(7, 19, dtype=np.int32)
    step(sender, receiver, {"a": a, "b": b})
    assert len(receiver) == 2
    step(sender, receiver, {"b": np.append(b, np.int32(1))})  # "a" finished
    assert len(receiver) == 1
    # a key seen again (a new request reusing a row's key) comes in full
    delta, decoded, _ = step(sender, receiver, {"a": np.append(a, np.int32(3))})
    assert delta.starts == [0] and len(receiver) == 1
    assert_same(decoded, {"a": np.append(a, np.int32(3))})


@pytest.mark.parametrize("rewrite", ["token changed", "shorter", "same length, new end"])
def test_a_rewritten_prefix_is_sent_in_full(rewrite):
    sender, receiver = DeltaSender(), DeltaReceiver()
    ctx = np.arange(40, dtype=np.int32)
    step(sender, receiver, {"a": ctx, "b": ctx + 1})
    if rewrite == "token changed":  # preempted, recomputed to something else
        new = ctx.copy()
        new[10] = 49
        new = np.append(new, np.int32(5))
    elif rewrite == "shorter":
        new = ctx[:25].copy()
    else:
        new = ctx.copy()
        new[-1] = 0
    contexts = {"a": new, "b": np.append(ctx + 1, np.int32(2))}
    delta, decoded, resend = step(sender, receiver, contexts)
    assert delta.starts == [0, 40] and not resend
    assert_same(decoded, contexts)


def test_a_receiver_that_lacks_a_context_gives_no_context_and_asks_for_it_in_full():
    sender = DeltaSender()
    ctx = {"a": np.arange(30, dtype=np.int32), "b": np.arange(3, 33, dtype=np.int32)}
    step(sender, DeltaReceiver(), ctx)
    fresh = DeltaReceiver()  # a restarted actor holds nothing
    ctx = {k: np.append(c, np.int32(1)) for k, c in ctx.items()}
    delta, decoded, resend = step(sender, fresh, ctx)
    assert delta.starts == [30, 30]
    assert decoded == {"a": None, "b": None} and resend == ["a", "b"]  # no wrong context
    ctx = {k: np.append(c, np.int32(2)) for k, c in ctx.items()}
    delta, decoded, resend = step(sender, fresh, ctx)
    assert delta.starts == [0, 0] and not resend  # sent in full after the resend
    assert_same(decoded, ctx)


def test_a_receiver_out_of_step_for_one_row_costs_that_row_only():
    sender, receiver = DeltaSender(), DeltaReceiver()
    ctx = {"a": np.arange(30, dtype=np.int32), "b": np.arange(3, 33, dtype=np.int32)}
    step(sender, receiver, ctx)
    ctx = {k: np.append(c, np.int32(1)) for k, c in ctx.items()}
    keys = list(ctx)
    delta = sender.encode(keys, [ctx[k] for k in keys])
    bad = delta._replace(checks=[delta.checks[0] + 1, delta.checks[1]])  # "a" held otherwise
    full, resend = receiver.decode(bad)
    assert full[0] is None and resend == ["a"]
    np.testing.assert_array_equal(full[1], ctx["b"])


def test_a_malformed_delta_never_raises():
    receiver = DeltaReceiver()
    receiver.decode(Delta(["a"], [0], [-1], [3], np.arange(3, dtype=np.int32)))  # an array
    full, resend = receiver.decode(Delta(["a", "b"], [3, 0], [2], [1], b"\0" * 20))
    assert full == [None, None] and resend == ["a", "b"] and len(receiver) == 0


def test_a_repeated_key_is_sent_in_full_each_time():
    sender, receiver = DeltaSender(), DeltaReceiver()
    a, b = np.arange(10, dtype=np.int32), np.arange(20, dtype=np.int32)
    step(sender, receiver, {"k": a})
    delta = sender.encode(["k", "k"], [np.append(a, np.int32(1)), b])
    assert delta.starts == [0, 0]
    full, resend = receiver.decode(delta)
    assert not resend
    np.testing.assert_array_equal(full[0], np.append(a, np.int32(1)))
    np.testing.assert_array_equal(full[1], b)


def test_bytes_per_step_follow_new_tokens_not_the_context():
    def step_bytes(n_ctx, batch=16, steps=5):
        rng = np.random.default_rng(1)
        sender, receiver = DeltaSender(), DeltaReceiver()
        contexts = {f"cmpl-{i:032x}-0": rng.integers(0, 50000, n_ctx).astype(np.int32)
                    for i in range(batch)}
        sizes = []
        for _ in range(steps):
            delta, decoded, _ = step(sender, receiver, contexts)
            assert_same(decoded, contexts)
            sizes.append(len(pickle.dumps(delta, protocol=5)))
            contexts = grow(rng, contexts, 4, 4)
        full = len(pickle.dumps([c for c in contexts.values()], protocol=5))
        return sizes, full

    sizes, full = step_bytes(16384)
    assert sizes[0] >= 16 * 16384 * 4 and full >= 16 * 16384 * 4  # the first step: in full
    assert max(sizes[1:]) < 2500  # 16 rows x 4 new tokens, their keys and offsets
    small, _ = step_bytes(1024)
    assert max(sizes[1:]) - max(small[1:]) <= 64  # O(new tokens), not O(context)


def test_drafts_keep_their_resend_through_pickle():
    d = Drafts([[1, 2], []], resend=["b"])
    back = pickle.loads(pickle.dumps(d, protocol=5))
    assert back == [[1, 2], []] and back.resend == ["b"]
    cloudpickle = pytest.importorskip("ray.cloudpickle")  # what Ray pickles returns with
    assert cloudpickle.loads(cloudpickle.dumps(d)).resend == ["b"]


# --- the wiring: DraftWorker decodes, the proposer encodes ---------------------------------

def worker(parallel=False):
    from duo_vllm.runtime.actor import DraftWorker

    be = FakeBackend()
    w = DraftWorker({"use_actor": False, "parallel": parallel, "budget": 3}, "fake.gguf",
                    None, k=3, backend_factory=lambda _: be)
    seen = []
    real = w.drafter.propose

    def spy(step, *args, **kw):
        seen.append([np.array(c) for c in step.contexts])
        return real(step, *args, **kw)

    w.drafter.propose = spy
    return be, w, seen


def test_the_worker_gives_the_drafter_full_contexts_and_drafts_as_before():
    be, w, seen = worker()
    sender = DeltaSender()
    ctx = [np.arange(1, 12, dtype=np.int32), np.arange(20, 35, dtype=np.int32)]
    for _ in range(4):
        drafts = w.propose(StepRequest(sender.encode(["a", "b"], ctx), [3, 3], 0.05))
        # nothing to resend; serial: nothing runs beside the target's step (its cores idle)
        assert drafts.resend == [] and drafts.idle
        assert drafts == [be.chain(int(c[-1]), 3) for c in ctx]
        for got, want in zip(seen[-1], ctx):
            np.testing.assert_array_equal(got, want)
        ctx = [np.append(c, np.int32(be.next_token(int(c[-1])))) for c in ctx]
    # full contexts too
    assert w.propose(StepRequest([ctx[0]], [3], 0.05)) == [be.chain(int(ctx[0][-1]), 3)]


def test_the_worker_drafts_the_rows_it_holds_and_asks_for_the_others():
    be, w, seen = worker()
    sender = DeltaSender()
    a, b = np.arange(1, 12, dtype=np.int32), np.arange(20, 35, dtype=np.int32)
    w.propose(StepRequest(sender.encode(["a", "b"], [a, b]), [3, 3], 0.05))
    w._contexts._held.pop("a")  # as if this worker had never seen "a"
    a, b = np.append(a, np.int32(7)), np.append(b, np.int32(8))
    drafts = w.propose(StepRequest(sender.encode(["a", "b"], [a, b]), [2, 3], 0.05, [0.0, 0.5]))
    assert drafts == [[], be.chain(8, 3)] and drafts.resend == ["a"]
    assert len(seen[-1]) == 1  # only "b" reached the drafter
    np.testing.assert_array_equal(seen[-1][0], b)


def test_a_step_that_cannot_wait_leaves_decoded_contexts_and_the_next_delta_works():
    be, w, seen = worker(parallel=True)
    try:
        sender = DeltaSender()
        ctx = [np.arange(1, 12, dtype=np.int32)]
        w.propose(StepRequest(sender.encode(["a"], ctx), [3], 0.05))
        assert wait_idle(w)
        ctx = [np.append(ctx[0], np.int32(5))]
        with w._lock:  # the drafter is busy: this step goes without a draft
            drafts = w.propose(StepRequest(sender.encode(["a"], ctx), [3], 0.05))
            assert drafts == [[]] and not hasattr(drafts, "resend")
            np.testing.assert_array_equal(w._stash.contexts[0], ctx[0])  # full, for the pre-draft
        assert wait_idle(w)
        ctx = [np.append(ctx[0], np.int32(6))]
        delta = sender.encode(["a"], ctx)
        assert delta.starts == [12]
        assert w.propose(StepRequest(delta, [3], 0.05)) == [be.chain(6, 3)]
        np.testing.assert_array_equal(seen[-1][0], ctx[0])
    finally:
        w.close()


class FakeClient:
    """ActorClient's interface over a receiver; ``restart`` swaps in an empty one."""

    def __init__(self):
        self.restarts = 0
        self.receiver = DeltaReceiver()
        self.deltas, self.seen = [], []
        self.answer = True

    def restart(self, noticed=True):
        self.receiver = DeltaReceiver()
        self.restarts += noticed

    def propose(self, step):
        delta = step.contexts
        self.deltas.append(delta)
        if not self.answer:  # stalled, restarting: the call may never reach the actor
            return None
        full, resend = self.receiver.decode(delta)
        self.seen.append(full)
        return Drafts([[] if c is None else [1] for c in full], resend)


def proposer(client):
    p = object.__new__(DuoProposer)
    p.config = DuoConfig()
    p.k = p.k_lookup = 2
    p.max_model_len, p.target_vocab_size = 1000, 50
    p._client, p._worker = client, None
    p._init_step_state()
    return p


def vllm_step(p, contexts):
    ids = np.zeros((len(contexts), 64), dtype=np.int32)
    for i, c in enumerate(contexts):
        ids[i, :len(c)] = c
    return p.propose([[c[-1]] for c in contexts], np.array([len(c) for c in contexts]), ids)


def test_the_proposer_resends_in_full_after_a_restart_or_an_unanswered_step():
    client = FakeClient()
    p = proposer(client)
    ctx = [list(range(1, 20)), list(range(5, 30))]

    def next_step(expect_starts, expect_drafts=([1], [1])):
        nonlocal ctx
        ctx = [c + [7] for c in ctx]
        assert vllm_step(p, ctx) == list(expect_drafts)
        assert client.deltas[-1].starts == expect_starts
        if client.answer:
            for got, want in zip(client.seen[-1], ctx):
                if got is not None:
                    assert list(got) == want

    next_step([0, 0])
    next_step([20, 26])
    client.restart()  # ActorClient started a new actor
    next_step([0, 0])
    next_step([22, 28])
    client.restart(noticed=False)  # an actor that holds nothing, unannounced
    next_step([23, 29], ([], []))  # no draft, and no wrong context
    next_step([0, 0])
    client.answer = False
    next_step([25, 31], ([], []))
    client.answer = True  # the unanswered call may not have reached the actor
    next_step([0, 0])
    next_step([27, 33])
