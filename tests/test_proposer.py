"""DuoProposer against the real default draft GGUF, with a stand-in for vLLM's config."""

import importlib.util
import logging
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from duo_vllm.config import nest_tuning
from duo_vllm.models import ModelNotFoundError
from duo_vllm.vllm.proposer import DuoProposer
from duo_vllm.vllm.vocab import VocabMismatchError

# the draft model's runtime; the upstream lane (scripts/test_upstream.sh) goes without it
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="needs llama-cpp-python (the draft model's runtime)")


def vllm_config(target, k=4, duo=None, max_model_len=2048):
    # options written flat here, as DuoProposer reads them (tuning nested)
    load = SimpleNamespace(model_loader_extra_config={"duo": nest_tuning(duo or {})})
    spec = SimpleNamespace(num_speculative_tokens=k, draft_load_config=load)
    model = SimpleNamespace(max_model_len=max_model_len, get_vocab_size=lambda: 49152,
                            tokenizer=target, trust_remote_code=False, model=target)
    return SimpleNamespace(speculative_config=spec, model_config=model)


def batch(contexts, width=256):
    ids = np.zeros((len(contexts), width), dtype=np.int32)
    for i, c in enumerate(contexts):
        ids[i, :len(c)] = c
    return ids, np.array([len(c) for c in contexts], dtype=np.int32)


@pytest.fixture(scope="module")
def inproc(target_dir):
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (the draft model's runtime)")
    return DuoProposer(vllm_config(target_dir, duo={"use_actor": False, "parallel": False,
                                                    "budget": 4}))


def test_propose_drafts_for_rows_that_sampled(inproc, tokenizer):
    a = tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    b = tokenizer.encode("1, 2, 3, 4, 5, 6, 7,")
    ids, n = batch([a, b, b])
    drafts = inproc.propose([[a[-1]], [], [b[-1]]], n, ids)
    assert len(drafts) == 3 and drafts[1] == []
    assert len(drafts[0]) == 4 and len(drafts[2]) == 4
    assert all(0 <= t < 49152 for t in drafts[0] + drafts[2])
    assert tokenizer.decode(drafts[2]).strip().startswith("8")


@needs_llama_cpp
def test_budget_is_clamped_at_max_model_len(target_dir, tokenizer):
    p = DuoProposer(vllm_config(target_dir, duo={"use_actor": False, "parallel": False,
                                                 "budget": 4},
                                max_model_len=24))
    ctx = list(range(1000, 1019))
    ids, n = batch([ctx[:17], ctx[:19]])
    drafts = p.propose([[1], [1]], n, ids)
    # vLLM drafts the next step only if every row's length + drafts + k (4) fits: 17 + 3 + 4
    assert [len(d) for d in drafts] == [3, 1] and p.stats()["unfit_steps"] == 0
    ids, n = batch([ctx[:17], ctx[:19] + [1, 2]])  # 21 + 4 > 24: vLLM skips a step
    drafts = p.propose([[1], [1]], n, ids)
    assert drafts[1] == [] and p.stats()["unfit_steps"] == 1


@pytest.mark.expect_swallowed(RuntimeError, reason="the draft side's injected crash")
def test_draft_failure_falls_back_to_plain_decoding(inproc, caplog):
    def broken(*_):
        raise RuntimeError("draft process crashed")

    worker = inproc._worker
    saved = worker.propose
    worker.propose = broken
    try:
        ids, n = batch([[1, 2, 3]])
        with caplog.at_level(logging.WARNING):
            assert inproc.propose([[3]], n, ids) == [[]]
        assert "falling back to plain decoding" in caplog.text
        worker.propose = saved
        assert inproc.propose([[3]], n, ids) == [[]]  # stays on plain decoding
        assert inproc.stats()["fallback"] is True
    finally:
        worker.propose = saved
        inproc._failed = False


def test_missing_draft_file_names_the_fix(target_dir):
    with pytest.raises(ModelNotFoundError, match="draft_model '/nonexistent/d.gguf' does not exist"):
        DuoProposer(vllm_config(target_dir, duo={"use_actor": False,
                                                 "draft_model": "/nonexistent/d.gguf"}))


def test_lookup_only_starts_no_draft_side_and_serves_the_contexts_copies(
        target_dir, monkeypatch, caplog):
    """lookup_only: no draft model, no actor, no prefetch; the drafts are copies from the
    context, scored as ever, and the periodic stats line comes without a draft side."""
    import duo_vllm.vllm.draft_side as draft_side_mod

    def no_draft_side(*_, **__):
        raise AssertionError("lookup_only started a draft side")

    monkeypatch.setattr(draft_side_mod, "DraftWorker", no_draft_side)
    monkeypatch.setattr(draft_side_mod, "ActorClient", no_draft_side)
    p = DuoProposer(vllm_config(target_dir, duo={"lookup_only": True}))
    assert p._client is None and p._worker is None and not p._prefetch and not p._on
    for e in range(5):  # the target's steps: verifying a token is nearly free
        p.step_time.observe(1, e, 0.050 + 0.0001 * e)
    ctx = [5, 6, 7, 8, 9, 10, 5, 6]  # "5 6" came before, followed by 7 8 9 10
    ids, n = batch([ctx])
    assert p.propose([[6]], n, ids) == [[7, 8, 9, 10]]
    ids, n = batch([ctx + [7, 8, 11]])  # two accepted, then the target's own token
    p._reporter.logged_at = float("-inf")  # the periodic stats line is due
    with caplog.at_level(logging.INFO):
        p.propose([[11]], n, ids)
    assert "lookups only" in caplog.text
    s = p.stats()
    assert s["lookup_tokens_served"] == 4 and s["lookup_tokens_accepted"] == 2
    assert s["propose_errors"] == 0
    p.hold()  # held: plain decoding, nothing to pause
    assert p.propose([[4]], *batch([ctx + [7, 8, 11, 4]])[::-1]) == [[]]
    assert p.stats()["propose_errors"] == 0


@needs_llama_cpp
def test_corrupt_gguf_is_rejected(target_dir, tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(ValueError, match="not a valid GGUF model"):
        DuoProposer(vllm_config(target_dir, duo={"use_actor": False, "draft_model": str(bad)}))


@pytest.fixture(scope="module")
def other_vocab_target(target_dir, tmp_path_factory):
    """The default target with one extra token: its vocabulary no longer matches the draft."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("other_vocab")
    for f in os.listdir(target_dir):
        if f.endswith(".safetensors"):
            os.symlink(os.path.join(target_dir, f), out / f)
        elif not f.startswith("tokenizer"):
            shutil.copy(os.path.join(target_dir, f), out / f)
    tok = AutoTokenizer.from_pretrained(target_dir)
    tok.add_tokens(["<duo_extra_token>"])
    tok.save_pretrained(out)
    return str(out)


@needs_llama_cpp
def test_vocab_mismatch_names_both_models(other_vocab_target):
    with pytest.raises(VocabMismatchError, match=r"SmolLM2-135M-Instruct.Q4_1.gguf.*other_vocab.*"
                                                r"draft has 49152 tokens, target tokenizer has 49153"):
        DuoProposer(vllm_config(other_vocab_target, duo={"use_actor": False}))


def _policy(tid: int) -> int | None:
    try:
        return os.sched_getscheduler(tid)
    except OSError:
        return None


def _affinity(tid: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(tid)
    except OSError:
        return None


@needs_llama_cpp
def test_ray_actor_is_named_pinned_and_shared(target_dir):
    import ray

    cfg = {"draft_cores": [1], "actor_name": "duo_test_actor", "namespace": "duo_test",
           "budget": 4}
    try:
        p1 = DuoProposer(vllm_config(target_dir, duo=cfg))
        info = p1._client.info
        assert info["cores"] == [1] and info["n_threads"] == 1 and info["pid"] != os.getpid()
        # on this node: the step's calls take the actor's Unix socket, not Ray
        assert p1._client.channel and p1.stats()["step_calls"] == "socket"
        # every thread of the actor's process, Ray's own and the socket's included, is off
        # the target's core
        masks = [_affinity(int(t)) for t in os.listdir(f"/proc/{info['pid']}/task")]
        masks = [m for m in masks if m is not None]  # a thread may end meanwhile
        assert len(masks) > 1 and set().union(*masks) == {1}
        # the private instance's daemons never preempt the target's threads; the actor,
        # forked by one of them, still drafts in the foreground
        import psutil

        ray_procs = psutil.Process().children(recursive=True)
        daemons = [p for p in ray_procs if p.name() in ("raylet", "gcs_server")]
        assert len(daemons) == 2
        assert {_policy(t.id) for p in daemons for t in p.threads()} - {None} == {os.SCHED_IDLE}
        actor = {_policy(int(t)) for t in os.listdir(f"/proc/{info['pid']}/task")}
        assert actor - {None} == {os.SCHED_OTHER}
        # no idle worker processes started ahead of need
        assert not [p for p in ray_procs if p.name() == "ray::IDLE"]
        assert ray.get_actor("duo_test_actor", namespace="duo_test") is not None
        with pytest.raises(ValueError):
            ray.get_actor("duo_test_actor", namespace="some_other_job")
        p2 = DuoProposer(vllm_config(target_dir, duo=cfg))  # attaches to the same actor
        assert p2._client.call("info")["pid"] == info["pid"]
        assert p2._client.channel  # a connection of its own to the same socket
        assert info["node_id"] == ray.get_runtime_context().get_node_id()
        ids, n = batch([[1, 2, 3, 4]])
        assert len(p2.propose([[4]], n, ids)[0]) == 4
    finally:
        ray.shutdown()


def test_cores_that_do_not_exist_are_a_startup_error(target_dir):
    from duo_vllm.config import DuoConfigError

    with pytest.raises(DuoConfigError, match=r"draft_cores \[4096\] name CPU\(s\) \[4096\] that "
                                             r"do not exist"):
        DuoProposer(vllm_config(target_dir, duo={"draft_cores": [4096]}))


@needs_llama_cpp
def test_corrupt_gguf_in_the_actor_is_a_readable_startup_error(target_dir, tmp_path):
    import ray

    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    try:
        with pytest.raises(Exception, match="not a valid GGUF model"):
            DuoProposer(vllm_config(target_dir, duo={"draft_model": str(bad), "draft_cores": [1],
                                                     "actor_name": "duo_test_corrupt"}))
    finally:
        ray.shutdown()
