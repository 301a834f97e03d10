"""The draft's prompt cache: evicted sequences kept in host memory and restored by prefix."""

import numpy as np
import pytest

from duo_vllm.draft.drafter import DraftPolicy, DuoDrafter
from duo_vllm.control.drafting import MIN_RESTORE, restore_pays
from duo_vllm.draft.prompt_cache import PromptCache
from duo_vllm.runtime.message import StepRequest
from tests.support.fakes import FakeBackend


def toks(*xs):
    return np.array(xs, dtype=np.int32)


def seq(start, n):
    return np.arange(start, start + n, dtype=np.int32)


# -- the cache itself ------------------------------------------------------------------

def test_best_is_the_entry_holding_the_longest_prefix():
    c = PromptCache(1 << 20)
    c.put(seq(0, 40), 0, 0, b"a" * 10)
    c.put(np.concatenate([seq(0, 20), seq(500, 30)]), 0, 0, b"b" * 10)
    entry, n = c.best(np.concatenate([seq(0, 40), seq(900, 5)]))
    assert n == 40 and entry.state == b"a" * 10
    entry, n = c.best(np.concatenate([seq(0, 20), seq(500, 10)]))
    assert n == 30 and entry.state == b"b" * 10
    assert c.best(seq(1000, 50)) == (None, 0)


def test_a_windowed_entry_matches_beyond_its_head_only():
    # a window of head 4 + the request's tokens from offset 30 on
    ctx = np.concatenate([seq(0, 30), seq(100, 20)])
    held = np.concatenate([ctx[:4], ctx[30:]])
    c = PromptCache(1 << 20)
    c.put(held, 4, 30, b"w")
    assert c.best(ctx)[1] == 24
    # another request that shares the head (the chat template) only: no match
    other = np.concatenate([seq(0, 30), seq(700, 20)])
    assert c.best(other) == (None, 0)
    # nor one shorter than the window's start
    assert c.best(seq(0, 25)) == (None, 0)


def test_least_recently_used_entries_go_beyond_the_budget():
    c = PromptCache(25)
    c.put(seq(0, 20), 0, 0, b"x" * 10)
    c.put(seq(100, 20), 0, 0, b"y" * 10)
    assert c.best(seq(0, 20))[1] == 20  # used: now the most recent
    c.put(seq(200, 20), 0, 0, b"z" * 10)  # 30 bytes > 25: the least recent (y) goes
    assert len(c) == 2 and c.bytes == 20
    assert c.best(seq(100, 20)) == (None, 0)
    assert c.best(seq(0, 20))[1] == 20 and c.best(seq(200, 20))[1] == 20
    c.put(seq(300, 20), 0, 0, b"!" * 26)  # larger than the whole budget: not kept
    assert len(c) == 2 and c.best(seq(300, 20)) == (None, 0)


def test_an_entry_extended_by_a_newer_one_is_dropped():
    c = PromptCache(1 << 20)
    c.put(seq(0, 20), 0, 0, b"old")
    c.put(seq(0, 30), 0, 0, b"newer")  # the same request, further on
    assert len(c) == 1 and c.bytes == 5
    c.put(seq(0, 30), 4, 10, b"window")  # another window of it: another entry
    assert len(c) == 2


def test_a_restore_must_spare_a_real_prefill():
    assert restore_pays(MIN_RESTORE + 10, 10, view_len=100, fresh=256)
    assert not restore_pays(MIN_RESTORE + 9, 10, view_len=100, fresh=256)
    # an entry that leaves more to evaluate than a window taken afresh would
    assert not restore_pays(100, 0, view_len=400, fresh=256)


def test_the_cache_needs_a_size():
    with pytest.raises(ValueError):
        PromptCache(0)


# -- the drafter with it -----------------------------------------------------------------

def drafter(cache_bytes, backend=None, window=None):
    be = backend or FakeBackend()
    policy = DraftPolicy(k=3, parallel=False, budget=3)
    return be, DuoDrafter(be, max_sequences=1, n_ctx=400, policy=policy, window=window,
                          cache_bytes=cache_bytes)


A = seq(1, 60)  # a prompt
B = seq(200, 50)  # another, that takes A's slot (one slot)


def evaluated(be):
    return sum(len(t) for _, t, _ in be.evaluated)


@pytest.mark.parametrize("window", [None, 32])
def test_a_prompt_back_after_its_slot_went_to_another_is_restored_not_prefilled(window):
    drafts = {}
    for cache in (0, 1 << 20):
        be, d = drafter(cache, window=window)
        (first,) = d.propose(StepRequest([A], [3]))
        d.propose(StepRequest([B], [3]))
        be.evaluated.clear()
        (again,) = d.propose(StepRequest([A], [3]))
        drafts[cache] = (first, again)
        n = evaluated(be)
        if cache:
            # only the last token (for its logits) and the chain's own tokens
            assert n == 1 + 2, be.evaluated
            assert d.stats.cache_hits == 1
            assert d.stats.cache_tokens == (len(A) if window is None else window) - 1
        else:
            assert n == (len(A) if window is None else window) + 2
            assert d.stats.cache_hits == 0
    assert drafts[0] == drafts[1 << 20]  # the same drafts: speed only
    assert drafts[0][0] == drafts[0][1] == FakeBackend().chain(int(A[-1]), 3)


def test_a_context_that_goes_on_from_a_cached_one_reuses_its_prefix():
    be, d = drafter(1 << 20)
    d.propose(StepRequest([A], [3]))
    d.propose(StepRequest([B], [3]))  # A goes to the cache
    be.evaluated.clear()
    turn2 = np.concatenate([A, seq(900, 10)])  # the next turn of A's chat, say
    (draft,) = d.propose(StepRequest([turn2], [3]))
    # A's cells restored: only the new turn is evaluated, then the chain
    assert be.evaluated[0][2] == len(A) and evaluated(be) == 10 + 2
    assert draft == FakeBackend().chain(int(turn2[-1]), 3)


class FailingRestore(FakeBackend):
    def restore(self, seq_id, state):
        return False


def test_a_failed_restore_prefills_as_without_a_cache():
    be, d = drafter(1 << 20, backend=FailingRestore())
    d.propose(StepRequest([A], [3]))
    d.propose(StepRequest([B], [3]))
    be.evaluated.clear()
    (draft,) = d.propose(StepRequest([A], [3]))
    assert be.evaluated[0][2] == 0 and evaluated(be) == len(A) + 2
    assert draft == FakeBackend().chain(int(A[-1]), 3)
    assert d.stats.cache_failures == 1 and d.stats.cache_hits == 0


def test_the_default_draft_restores_a_sequence_exactly(tmp_path):
    """llama.cpp's own save and restore of one sequence (LlamaCppBackend.save/restore):
    restored into another sequence of the unified cache, beside others, the next
    token's logits are those of the sequence evaluated there."""
    from duo_vllm.draft.backend import LlamaCppBackend
    from duo_vllm.models import default_draft_gguf, prepare_draft

    be = LlamaCppBackend(prepare_draft(default_draft_gguf(), "auto", root=tmp_path),
                         n_ctx=1024, n_seq=4, n_threads=1)
    try:
        prompt = np.random.default_rng(0).integers(100, 20000, 97).astype(np.int32)
        be.decode([(0, prompt[:96], 0)])
        want = be.decode([(0, prompt[96:], 96)])[0].copy()
        be.remove(0, 96, -1)
        be.decode([(1, prompt[:30], 0)])  # another sequence's cells beside it
        state = be.save(0)
        assert len(state) > 0
        be.remove(0, 0, -1)
        assert be.restore(2, state)
        got = be.decode([(2, prompt[96:], 96)])[0]
        np.testing.assert_array_equal(got, want)
        assert not be.restore(3, bytearray(16))  # not a saved state: refused, no crash
    finally:
        be.close()


def test_a_prefetched_prompt_seen_before_is_restored_and_its_first_step_hits():
    """vLLM prefills a prompt whose draft sequence went to the cache meanwhile: the
    pre-draft restores it and drafts past it at once, evaluating its last token only."""
    be = FakeBackend()
    d = DuoDrafter(be, max_sequences=2, n_ctx=1000, cache_bytes=1 << 20,
                   policy=DraftPolicy(k=3, parallel=True, multi_sequence=False, budget=3))
    prompt = np.array([(7 * i) % 50 for i in range(150)], dtype=np.int32)
    others = [np.array([(3 * i + j) % 50 for i in range(120)], dtype=np.int32)
              for j in (1, 2)]

    def request(p):  # vLLM prefills it, then its first step
        assert d.prefetch([p]) == 1
        d.predraft()
        b = be.next_token(int(p[-1]))
        return d.propose(StepRequest([np.append(p, np.int32(b))], [3]))[0], b

    request(prompt)
    for p in others:  # each takes a slot the last step did not use: the prompt's goes
        request(p)
    be.evaluated.clear()
    draft, b = request(prompt)
    sid = next(s.seq_id for s in d.pool.slots if len(s.tokens) > len(prompt)
               and np.array_equal(s.tokens[:len(prompt)], prompt))
    mine = [(t, pos) for seq_id, t, pos in be.evaluated if seq_id == sid]
    assert mine[0] == ([int(prompt[-1])], len(prompt) - 1)  # its cells came back
    assert d.stats.cache_hits == 1 and d.stats.cache_tokens == len(prompt) - 1
    assert draft == be.chain(b, 3) and d.stats.predraft_hits == 4
