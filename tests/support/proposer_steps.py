"""DuoProposer's steps driven by hand: a proposer without vLLM or an actor
(:func:`bare`), a draft worker that records each step (:class:`FakeDraftWorker`),
the steps' inputs as vLLM hands them (:func:`inputs`), and a clock the test
moves (:func:`hand_clock`, the ``clock`` fixture of tests/conftest.py)."""

import numpy as np

from duo_vllm.config import DuoConfig
from duo_vllm.control.verdict import LOOKUP, MODEL
from duo_vllm.runtime.delta import Delta, DeltaReceiver
from duo_vllm.stats import DraftStats
from duo_vllm.vllm import lender as lender_mod
from duo_vllm.vllm import proposer as proposer_mod
from duo_vllm.vllm.proposer import DuoProposer


def on_mode(on: bool) -> str:
    """The verdict's mode for a test that says whether the model drafts."""
    return MODEL if on else LOOKUP


class FakeDraftWorker:
    """The in-process draft side (DraftWorker's place with ``use_actor: false``): records
    each step's request and answers ``drafts`` (default ``[1, 2, 3, 4]`` a row)."""

    def __init__(self, drafts=None):
        self.calls = []
        self.drafts = drafts
        self.receiver = DeltaReceiver()  # the proposer sends deltas, as to DraftWorker

    def propose(self, step):
        contexts = step.contexts
        if isinstance(contexts, Delta):
            contexts, resend = self.receiver.decode(contexts)
            assert not resend and all(c is not None for c in contexts)
        self.calls.append(dict(contexts=[list(c) for c in contexts], budgets=step.budgets,
                               step_s=step.step_s, temps=step.temperatures,
                               per_token_s=step.per_token_s, hints=step.hints,
                               remaining=step.remaining))
        return self.drafts or [[1, 2, 3, 4] for _ in contexts]

    def stats(self):
        """What DraftWorker.stats() says for a worker that drafted nothing itself (the
        proposer logs it every ten seconds of steps)."""
        nan = float("nan")
        return {**DraftStats().as_dict(), "draft_token_ms": nan, "draft_prefill_token_ms": nan,
                "lock_wait_ms": 0.0, "actor_propose_ms": 0.0, "target_step_ms": nan,
                "verify_token_ms": nan, "draft_call_ms_by_width": {}, "cache_mb": 0.0,
                "acceptance_greedy": nan, "acceptance_sampled": nan}


class Clock:
    """The proposer's ``time`` module, moved by hand (``clock.now += 0.05``)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def monotonic(self):
        return self.now


def hand_clock(monkeypatch) -> Clock:
    """A :class:`Clock` in place of the proposer's time (the ``clock`` fixture)."""
    c = Clock()
    monkeypatch.setattr(proposer_mod, "time", c)
    monkeypatch.setattr(lender_mod, "time", c)  # the proposer's lending half
    return c


def bare(worker, vocab=50, k=4):
    """A DuoProposer on ``worker`` in process, built without vLLM's config."""
    p = object.__new__(DuoProposer)
    p.config = DuoConfig(use_actor=False)
    p.k, p.max_model_len, p.target_vocab_size = k, 100, vocab
    p.k_lookup = k
    p._client, p._worker = None, worker
    p._init_step_state()
    return p


def inputs(contexts, width=32):
    """propose()'s arguments for these contexts: each row's last token, the lengths, the
    token table."""
    ids = np.zeros((len(contexts), width), dtype=np.int32)
    for i, c in enumerate(contexts):
        ids[i, :len(c)] = c
    return [[c[-1]] if c else [] for c in contexts], np.array([len(c) for c in contexts]), ids
