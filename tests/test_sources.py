"""Draft sources behind one interface (duo_vllm/sources/base.py): a third source is one
class and its registration, served and scored through the same path as the lookups."""

import pytest

from duo_vllm.config import DuoConfig
from duo_vllm.control.verdict import LOOKUP, MODEL
from duo_vllm.sources import base
from duo_vllm.sources.base import Proposal, Sources, free_sources, register
from duo_vllm.sources.lookup import ContextLookup
from duo_vllm.vllm.model_source import ModelSource
from tests.support.proposer_steps import FakeDraftWorker, bare, inputs


class Repeat:
    """A toy source: the context's last token, again and again, at a fixed α."""

    def __init__(self):
        self.seen, self.scores = [], []

    def begin(self, key):
        self.seen.append(("begin", key))

    def draft(self, key, context, k, reg):
        return Proposal(self.name, [int(context[-1])] * k, 0.9)

    def accept(self, key, reg, proposal, accepted, judged):
        self.scores.append((key, accepted, judged))

    def end(self, key):
        self.seen.append(("end", key))

    def alpha(self, key, reg):
        return 0.9

    def summary(self):
        return {"repeat_scores": len(self.scores)}


@pytest.fixture
def repeat(monkeypatch):
    monkeypatch.setattr(base, "SOURCES", dict(base.SOURCES))
    return register("repeat")(Repeat)


def proposer(worker, cfg):
    p = bare(worker, k=2)
    p.k_lookup = 4
    p.sources = Sources(ModelSource(), free_sources(cfg))
    for e in range(0, 5):  # verifying a token is nearly free: every token pays
        p.step_time.observe(1, e, 0.050 + 0.0001 * e)
    return p


def test_a_registered_source_is_built_after_the_lookups_and_only_where_enabled(repeat):
    assert [type(s) for s in free_sources(DuoConfig())] == [ContextLookup, Repeat]
    assert [type(s) for s in free_sources(DuoConfig(lookup=False))] == [Repeat]
    assert Repeat.name == "repeat"


def test_a_third_source_is_served_and_scored_through_the_same_path(clock, repeat):
    w = FakeDraftWorker()
    p = proposer(w, DuoConfig(lookup=False))
    p._gated = False
    p._mode, p._on = LOOKUP, False  # the draft model off: the free sources alone
    ctx = [3, 1, 4, 1, 5]  # no earlier n-gram: only the toy proposes
    assert p.propose(*inputs([ctx])) == [[5, 5, 5, 5]]
    assert w.calls == []
    p.propose(*inputs([ctx + [5, 5, 9]]))  # the target accepted two, then said 9
    toy = p.sources.by_name["repeat"]
    assert toy.scores == [(("row", 0), 2, 3)] and toy.seen == [("begin", ("row", 0))]
    s = p._local_stats()
    assert s["repeat_tokens_served"] == 4 and s["repeat_tokens_accepted"] == 2
    assert s["repeat_scores"] == 1
    p.propose(*inputs([[7, 7], [8, 8]]))  # (no runner: the rows are the requests' keys)
    p.propose(*inputs([[7, 7, 7]]))  # the second request left the batch
    assert toy.seen[1:] == [("begin", ("row", 1)), ("end", ("row", 1))]


def test_the_drafter_is_told_every_free_proposal_and_the_model_draft_competes(clock, repeat):
    w = FakeDraftWorker(drafts=[[5, 6]])  # the model agrees with the toy's first token
    p = proposer(w, DuoConfig())
    p._gated = False
    ctx = [5, 6, 7, 8, 9, 10, 5, 6]  # a lookup match ("5 6" -> 7 8 9 10) and the toy's 6s
    drafts = p.propose(*inputs([ctx]))
    (hint,) = w.calls[-1]["hints"]
    assert [(q.source, q.tokens) for q in hint.proposals] == [
        (LOOKUP, [7, 8, 9, 10]), ("repeat", [6, 6, 6, 6])]
    # the model's [5, 6] and the lookup part at once: the model (prior 0.7) beats the
    # lookup's prior there; the toy parts with the model too, and its 0.9 wins
    assert drafts == [[6, 6, 6, 6]]
    assert p.sources.summary()[f"{MODEL}_tokens_served"] == 0
