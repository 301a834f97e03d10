"""Sampled drafts: q, its draws, and vLLM's rejection sampler reading it.

The statistical tests run vLLM's own ``rejection_sample`` (its CPU kernels)
on hand-built logits with seeded generators: the output must follow the
target's p when drafts are drawn from the q handed over, and the test must
catch a q that is not the one the drafts were drawn from.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from scipy.stats import chisquare

from duo_vllm.runtime.delta import Drafts
from duo_vllm.draft.drafter import DraftPolicy, DuoDrafter
from duo_vllm.control.serving import serve
from duo_vllm.control.verdict import MODEL
from duo_vllm.draft.sampling import dense_q, draft_q, sample_q
from duo_vllm.runtime.message import StepRequest
from tests.support.fakes import FakeBackend, hint_of

P_MIN = 1e-3


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_q_is_the_tempered_softmax_cut_to_its_top_tokens():
    logits = np.array([0.0, 3.0, 1.0, 2.0, -1.0], dtype=np.float32)
    ids, probs = draft_q(logits, 0.5, k=3)
    assert list(ids) == [1, 3, 2]
    assert probs.sum() == pytest.approx(1.0)
    assert probs == pytest.approx(softmax(logits[[1, 3, 2]] / 0.5))
    ids, _ = draft_q(logits, 1.0, k=3, limit=3)  # ids at or above the limit are never in q
    assert list(ids) == [1, 2, 0]


def test_draws_follow_q():
    ids, probs = draft_q(np.log(np.array([0.5, 0.3, 0.15, 0.05])), 1.0, k=4)
    rng = np.random.default_rng(0)
    draws = [sample_q(ids, probs, rng) for _ in range(4000)]
    counts = np.bincount(draws, minlength=4)[ids]
    assert chisquare(counts, probs * len(draws)).pvalue > P_MIN


def test_drafts_without_q_are_one_hot_and_no_q_at_all_is_none():
    q = [(np.array([3, 1]), np.array([0.75, 0.25], dtype=np.float32))]
    dense = dense_q([[3], [2, 4], []], [q, None, None], vocab=5).numpy()
    assert dense.shape == (3, 2, 5)
    assert list(dense[0, 0]) == [0, 0.25, 0, 0.75, 0]
    assert list(dense[1, 0]) == [0, 0, 1, 0, 0] and list(dense[1, 1]) == [0, 0, 0, 0, 1]
    assert not dense[2].any() and not dense[0, 1].any()
    assert dense_q([[3], [2]], [None, None], vocab=5) is None  # vLLM's own reading: no array


# -- vLLM's rejection sampler, on the CPU kernels ------------------------------------

def _vllm_rejection_sample(draft_ids, draft_probs, target_logits, seed=0):
    """vLLM's ``rejection_sample`` at temperature 1: one draft token per request."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU rejection kernels")
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import rejection_sample

    n, _ = target_logits.shape
    meta = SamplingMetadata(
        temperature=torch.ones(n), all_greedy=False, all_random=True, top_p=None,
        top_k=None, generators={}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    torch.manual_seed(seed)
    out = rejection_sample(
        torch.tensor(draft_ids, dtype=torch.int32), [1] * n, 1,
        torch.arange(1, n + 1, dtype=torch.int32),
        None if draft_probs is None else torch.from_numpy(draft_probs).contiguous(),
        torch.from_numpy(target_logits), torch.zeros((n, 1), dtype=torch.int32), meta)
    return out[:, 0].numpy()


N, V = 6000, 12


@pytest.fixture(scope="module")
def case():
    """A target p and a draft q that differ, drafts drawn from q's top 8."""
    rng = np.random.default_rng(1)
    p_logits = (2 * rng.normal(size=V)).astype(np.float32)
    q_logits = p_logits + rng.normal(size=V).astype(np.float32)
    q = draft_q(q_logits, 1.0, k=8)
    drafts = [[sample_q(*q, rng)] for _ in range(N)]
    return SimpleNamespace(p=softmax(p_logits.astype(np.float64)), q=q, drafts=drafts,
                           target=np.tile(p_logits, (N, 1)))


def test_vllm_keeps_the_target_distribution_with_drawn_drafts_and_their_q(case):
    dense = dense_q(case.drafts, [[case.q]] * N, V).reshape(N, V).numpy()
    first = _vllm_rejection_sample([d[0] for d in case.drafts], dense, case.target)
    assert chisquare(np.bincount(first, minlength=V), case.p * N).pvalue > P_MIN
    # and a draft is accepted with probability sum(min(p, q)), more than p(x) alone
    q_full = np.zeros(V)
    q_full[case.q[0]] = case.q[1]
    accepted = np.mean(first == np.array([d[0] for d in case.drafts]))
    assert accepted == pytest.approx(np.minimum(case.p, q_full).sum(), abs=0.02)
    assert accepted > (q_full * case.p).sum() + 0.05  # vLLM's reading without q


def test_the_test_catches_a_q_the_drafts_were_not_drawn_from(case):
    ids = case.q[0]
    wrong = (ids, np.full(len(ids), 1.0 / len(ids), dtype=np.float32))  # uniform over them
    dense = dense_q(case.drafts, [[wrong]] * N, V).reshape(N, V).numpy()
    first = _vllm_rejection_sample([d[0] for d in case.drafts], dense, case.target)
    assert chisquare(np.bincount(first, minlength=V), case.p * N).pvalue < P_MIN


# -- the drafter draws sampled requests' drafts ---------------------------------------

def spread_backend():
    """After any token, the draft is unsure among 4 tokens (logits 2, 1.5, 1, 0)."""
    be = FakeBackend()
    be.spread = {t: {10: 2.0, 11: 1.5, 12: 1.0, 13: 0.0} for t in range(50)}
    return be


def test_sampled_rows_get_drafts_drawn_from_q_and_greedy_rows_the_argmax():
    be = spread_backend()
    d = DuoDrafter(be, max_sequences=4, n_ctx=100, seed=0,
                   policy=DraftPolicy(k=3, parallel=False, budget=3, sampled_drafts=True))
    firsts = []
    for i in range(400):
        greedy, sampled = d.propose(StepRequest([np.array([1, 2, 3 + i % 5], dtype=np.int32),
                                                 np.array([4, 5, 6 + i % 5], dtype=np.int32)],
                                                [3, 3], temperatures=[0.0, 1.0]))
        assert greedy == [10, 10, 10] and d.last_q[0] is None
        q = d.last_q[1]
        assert len(q) == 3 and all(tok in ids for tok, (ids, _) in zip(sampled, q))
        firsts.append(sampled[0])
    ids, probs = q[0]  # the first token's q: tokens 10, 11, 12, and the rest pooled
    p = {int(t): float(x) for t, x in zip(ids, probs)}
    expected = np.array([p[10], p[11], p[12], 1 - p[10] - p[11] - p[12]]) * len(firsts)
    counts = [firsts.count(10), firsts.count(11), firsts.count(12)]
    counts.append(len(firsts) - sum(counts))
    assert chisquare(counts, expected).pvalue > P_MIN
    # a vocabulary limit (the target's): no draw at or above it
    d.policy = DraftPolicy(k=3, parallel=False, budget=3, sampled_drafts=True, vocab_limit=12)
    for i in range(50):
        step = StepRequest([np.array([7, 8 + i % 3], dtype=np.int32)], [3], temperatures=[1.0])
        assert max(d.propose(step)[0]) < 12
    # off: the argmax for every request, no q
    d.policy = DraftPolicy(k=3, parallel=False, budget=3, sampled_drafts=False)
    step = StepRequest([np.array([7, 8], dtype=np.int32)], [3], temperatures=[1.0])
    assert d.propose(step) == [[10] * 3]
    assert d.last_q == [None]


def test_a_pre_drafted_branch_of_a_sampled_request_is_served_with_its_q():
    be = spread_backend()
    d = DuoDrafter(be, max_sequences=4, n_ctx=100, seed=0,
                   policy=DraftPolicy(k=3, parallel=True, multi_sequence=False, budget=3,
                                      sampled_drafts=True))
    (draft,) = d.propose(StepRequest([np.array([1, 2], dtype=np.int32)], [3], temperatures=[0.8]))
    d.predraft()
    b = d.trees[0].branches[0].tokens[0]  # the target takes the branch's token
    (draft2,) = d.propose(StepRequest([np.array([1, 2, *draft, b], dtype=np.int32)], [3],
                                      temperatures=[0.8]))
    assert d.stats.predraft_hits == 1
    assert len(draft2) == 3 and d.last_q[0] is not None and len(d.last_q[0]) == 3


def test_the_worker_returns_q_with_the_drafts():
    from duo_vllm.runtime.actor import DraftWorker

    w = DraftWorker({"use_actor": False, "parallel": False, "budget": 2}, "fake.gguf", None,
                    k=2, backend_factory=lambda _: spread_backend())
    try:
        out = w.propose(StepRequest([np.array([1, 2], dtype=np.int32),
                                     np.array([3, 4], dtype=np.int32)], [2, 2], 0.05, [0.0, 1.0]))
        assert isinstance(out, Drafts) and out.q[0] is None and len(out.q[1]) == 2
        plain = w.propose(StepRequest([np.array([5, 6], dtype=np.int32)], [2], 0.05, [0.0]))
        assert plain.q is None and plain.idle  # nothing drawn; serial: nothing in the background
    finally:
        w.close()


def test_a_drawn_draft_is_served_as_drawn_whatever_the_lookup_says():
    hint = hint_of([7, 8, 9, 10], alpha_model=0.5, alpha_lookup=0.9, threshold=0.1)
    assert serve([7, 3], True, hint) == ([7, 3], MODEL)  # not cut where it parts
    assert serve([7, 8], True, hint) == ([7, 8], MODEL)  # not extended where it agrees
    assert serve([7, 8], False, hint)[0] == [7, 8, 9, 10]  # an argmax draft: combined
    assert serve([], True, hint)[0] == [7, 8, 9, 10]  # no draft: the lookup's
