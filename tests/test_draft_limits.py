"""Long contexts and many rows (issue 14, item 6): the draft's n_ctx and
max_sequences follow vLLM's max_model_len and max_num_seqs, within the draft
model's training context and a KV-cache bound; all with fakes."""

import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from duo_vllm.runtime.actor import DraftWorker
from duo_vllm.config import (
    DRAFT_KV_TOKENS, LLAMA_MAX_SEQ, MAX_DEFAULT_SEQUENCES, DuoConfig, DuoConfigError,
    derive_draft_limits,
)
from duo_vllm.runtime.message import StepRequest
from tests.support.fakes import FakeBackend
from tests.support.fake_llama_cpp import FakeLlamaCpp


def vllm_config(max_num_seqs=256, max_model_len=32768):
    return SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
                           model_config=SimpleNamespace(max_model_len=max_model_len))


def test_long_context_and_big_batch_follow_vllm_within_the_draft():
    lim = derive_draft_limits(256, 32768, 8192, {})
    assert (lim.n_ctx, lim.max_sequences) == (8192, DRAFT_KV_TOKENS // 8192)
    assert len(lim.warnings) == 1
    assert "max_model_len 32768 is above the draft model's training context" in lim.warnings[0]
    assert "the draft keeps 8 of vLLM's max_num_seqs 256" in lim.notes[0]


def test_a_short_max_model_len_leaves_room_for_more_rows():
    lim = derive_draft_limits(256, 2048, 8192, {})
    # 16 (the default's cap: idle slots' cells slow every draft token), not 8, nor 32
    # (the KV bound at n_ctx 2048), nor vLLM's default 256; said as a note, not a warning
    assert (lim.n_ctx, lim.max_sequences, lim.warnings) == (2048, MAX_DEFAULT_SEQUENCES, ())
    assert "the default's cap" in lim.notes[0]
    lim = derive_draft_limits(12, 2048, 8192, {})
    assert (lim.max_sequences, lim.notes) == (12, ())
    lim = derive_draft_limits(16, 4096, 8192, {})
    assert (lim.n_ctx, lim.max_sequences, lim.warnings) == (4096, 16, ())


def test_a_long_trained_draft_is_still_bounded_by_the_kv_cache():
    lim = derive_draft_limits(4, 131072, 131072, {})
    assert lim.n_ctx == DRAFT_KV_TOKENS // 8 and lim.max_sequences == 8
    assert "KV cache" in lim.warnings[0]


def test_the_users_values_are_kept_but_bounded():
    lim = derive_draft_limits(256, 32768, 8192, {"n_ctx": 16384, "max_sequences": 100})
    assert (lim.n_ctx, lim.max_sequences) == (8192, LLAMA_MAX_SEQ // 4)
    assert "n_ctx 16384 is above the draft model's training context (8192" in lim.warnings[0]
    assert "max_sequences 100" in lim.warnings[1]
    lim = derive_draft_limits(256, 32768, 8192, {"n_ctx": 512, "max_sequences": 3})
    assert (lim.n_ctx, lim.max_sequences, lim.warnings) == (512, 3, ())


def test_without_vllm_the_old_defaults_stand():
    assert derive_draft_limits(None, None, 0, {}) == derive_draft_limits(None, None, None, {})
    lim = derive_draft_limits(None, None, 8192, {})
    assert (lim.n_ctx, lim.max_sequences, lim.warnings) == (2048, 8, ())


def test_follow_vllm_keeps_what_the_user_set():
    cfg = DuoConfig.from_sources({"duo": {"n_ctx": 1024}}, environ={}).follow_vllm(
        vllm_config(64, 32768))
    assert cfg.vllm_limits == {"max_num_seqs": 64, "max_model_len": 32768, "vocab_size": None,
                               "given": ["n_ctx"]}
    # what the actor receives (to_dict -> JSON -> from_dict) still knows
    lim = DuoConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))).draft_limits(8192, 4)
    assert (lim.n_ctx, lim.max_sequences) == (1024, MAX_DEFAULT_SEQUENCES)
    lim = DuoConfig.from_sources(None, environ={}).follow_vllm(vllm_config(64, 32768)) \
        .draft_limits(8192, 4)
    assert (lim.n_ctx, lim.max_sequences) == (8192, 8)


def test_vllm_limits_is_no_user_option():
    with pytest.raises(DuoConfigError, match=r"unknown DuoProposer option\(s\) \['vllm_limits'\]"):
        DuoConfig.from_sources({"duo": {"vllm_limits": {}}}, environ={})


class TrainedFake(FakeBackend):
    n_ctx_train = 8192


class ShortTrainedFake(FakeBackend):
    n_ctx_train = 4096


def worker(cfg, backend=TrainedFake):
    return DraftWorker(cfg.to_dict(), "fake.gguf", None, k=3,
                       backend_factory=lambda _: backend())


def test_the_actor_clamps_n_ctx_to_the_training_context():
    """n_ctx 16384 on a draft trained on 8192: the drafter's per-request context is
    8192 (before: 16384, with only a warning)."""
    w = worker(DuoConfig(n_ctx=16384, parallel=False))
    try:
        assert w.drafter.n_ctx == 8192 and w.info()["n_ctx"] == 8192
        assert "n_ctx 16384 is above" in w.limits.warnings[0]  # logged at start-up
    finally:
        w.close()


def test_the_actor_follows_vllm():
    w = worker(DuoConfig(parallel=False).follow_vllm(vllm_config(64, 32768)))
    try:
        assert (w.drafter.n_ctx, w.drafter.pool.size) == (8192, 8)  # before: 2048, 8
        assert w.info()["max_sequences"] == 8
        long_ctx = np.arange(5000, dtype=np.int32) % 50
        assert w.propose(StepRequest([long_ctx], [3])) != [[]]  # before: past n_ctx 2048, no draft
    finally:
        w.close()
    w = worker(DuoConfig(parallel=False).follow_vllm(vllm_config(64, 32768)), ShortTrainedFake)
    try:  # the training context bounds n_ctx; the KV bound then allows more rows
        assert (w.drafter.n_ctx, w.drafter.pool.size) == (4096, 16)
    finally:
        w.close()
    w = worker(DuoConfig(parallel=False).follow_vllm(vllm_config(12, 2048)))
    try:
        assert (w.drafter.n_ctx, w.drafter.pool.size) == (2048, 12)  # before: 8 rows
    finally:
        w.close()


@pytest.mark.expect_swallowed(AttributeError, reason='the fake C API cannot decode')
def test_llama_cpp_is_sized_after_the_model_says_its_training_context(monkeypatch, tmp_path):
    """The real backend path: the KV cache is allocated for the clamped context, not
    for vLLM's max_model_len nor the user's n_ctx above the training context."""
    import duo_vllm.draft.backend as backend_mod
    import duo_vllm.models as models

    class Recording(FakeLlamaCpp):
        def llama_model_n_ctx_train(self, model):
            return 4096

        def llama_init_from_model(self, model, params):
            self.context_params = params
            return object()

    fake = Recording()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setattr(backend_mod, "_install_log_filter", lambda lib: None)
    monkeypatch.setattr(models, "prepare_draft", lambda path, quant, log=None: path)
    model = tmp_path / "draft.gguf"
    model.write_bytes(b"GGUF")
    cfg = DuoConfig(parallel=False).follow_vllm(vllm_config(256, 32768))
    w = DraftWorker(cfg.to_dict(), str(model), None, k=3)
    try:
        room = 4 * (3 + 2)  # max_branches * (k + 2): the branches' tokens
        # 16 requests of 4096 tokens, not 8 of 32768 (max_model_len) or of 8192 (KV bound)
        assert fake.context_params.n_ctx == 16 * (4096 + room)
        assert fake.context_params.n_seq_max == 16 * 4
        assert w.drafter.n_ctx == 4096 and w.backend.n_ctx_train == 4096
    finally:
        w.close()


def test_the_proposer_hands_vllms_limits_to_the_actor(monkeypatch):
    pytest.importorskip("vllm")
    from duo_vllm.vllm import proposer as proposer_mod
    from duo_vllm.vllm import draft_side as draft_side_mod
    from tests.support.vllm_fakes import fake_groups, spec_config

    fake_groups(monkeypatch, 0)
    seen = {}

    class Stop(Exception):
        pass

    def capture(cfg, cores=None):
        seen["cfg"] = cfg
        raise Stop
    monkeypatch.setattr(draft_side_mod, "_ensure_ray", capture)
    monkeypatch.setattr(proposer_mod.DuoProposer, "_draft_cores", staticmethod(lambda cfg: [0]))
    config = spec_config()
    config.scheduler_config = SimpleNamespace(max_num_seqs=128)
    with pytest.raises(Stop):
        proposer_mod.DuoProposer(config)
    assert seen["cfg"].vllm_limits == {"max_num_seqs": 128, "max_model_len": 2048,
                                       "vocab_size": 49152, "given": []}
    assert seen["cfg"].target_vocab_size() == 49152 and seen["cfg"].sampled_drafts
    # with tensor parallelism every rank verifies, but only one drafts: no drawn drafts
    config.parallel_config.tensor_parallel_size = 2
    with pytest.raises(Stop):
        proposer_mod.DuoProposer(config)
    assert not seen["cfg"].sampled_drafts
