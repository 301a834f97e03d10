import numpy as np

from duo_vllm.drafter import ChainDrafter
from tests.fakes import FakeBackend


def ctx(*xs):
    return np.array(xs, dtype=np.int32)


def test_greedy_chain_follows_argmax():
    be = FakeBackend()
    d = ChainDrafter(be, max_sequences=2, n_ctx=100)
    (draft,) = d.draft([ctx(1, 2, 3)], [4])
    assert draft == be.chain(3, 4)


def test_only_new_tokens_are_evaluated():
    be = FakeBackend()
    d = ChainDrafter(be, max_sequences=2, n_ctx=100)
    (draft,) = d.draft([ctx(1, 2, 3)], [3])
    be.evaluated.clear()
    # the target accepted the first two draft tokens and sampled 9
    (draft2,) = d.draft([ctx(1, 2, 3, draft[0], draft[1], 9)], [3])
    first = be.evaluated[0]
    assert first[1] == [9] and first[2] == 5  # only the new token, at its position
    assert draft2 == be.chain(9, 3)
    assert d.stats.reused_tokens == 5


def test_fully_known_context_reevaluates_last_token_for_logits():
    be = FakeBackend()
    d = ChainDrafter(be, max_sequences=1, n_ctx=100)
    d.draft([ctx(1, 2, 3)], [3])  # caches 1 2 3 d0 d1
    be.evaluated.clear()
    (draft,) = d.draft([ctx(1, 2, 3)], [2])  # same context again
    assert be.evaluated[0][1:] == ([3], 2)
    assert draft == be.chain(3, 2)


def test_rows_get_independent_state():
    be = FakeBackend()
    d = ChainDrafter(be, max_sequences=4, n_ctx=100)
    out = d.draft([ctx(1, 2), ctx(10, 11, 12)], [2, 3])
    assert out == [be.chain(2, 2), be.chain(12, 3)]
    be.evaluated.clear()
    out = d.draft([ctx(10, 11, 12, out[1][0], 4), ctx(1, 2, out[0][0], 6)], [2, 2])
    assert out == [be.chain(4, 2), be.chain(6, 2)]
    assert [e[1][0] for e in be.evaluated if len(e[1]) > 1 or e[1][0] in (4, 6)][:2] == [4, 6]


def test_context_too_long_or_zero_budget_gets_no_draft():
    be = FakeBackend()
    d = ChainDrafter(be, max_sequences=2, n_ctx=4)
    assert d.draft([ctx(1, 2, 3, 4), ctx(1)], [2, 0]) == [[], []]
    assert d.draft([ctx(1, 2, 3)], [5]) == [be.chain(3, 1)]  # clamped to fit n_ctx


def test_backend_error_gives_no_draft_and_resets_slot():
    class Broken(FakeBackend):
        def eval(self, seq_id, tokens, pos):
            raise RuntimeError("boom")

    d = ChainDrafter(Broken(), max_sequences=1, n_ctx=100)
    assert d.draft([ctx(1, 2)], [3]) == [[]]
    assert d.stats.errors == 1 and len(d.pool.slots[0].tokens) == 0
