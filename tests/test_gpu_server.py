"""What a GPU server changes, checked here with fakes: the draft stays off the GPU."""

import sys

import pytest

from duo_vllm.runtime.actor import NO_GPU_ENV, actor_options
from duo_vllm.config import DuoConfig, DuoConfigError
from tests.support.fake_llama_cpp import FakeLlamaCpp
from tests.support.vllm_fakes import fake_groups, spec_config


@pytest.mark.parametrize("layers, want", [(0, 0), (5, 5), (-1, 2 ** 31 - 1)])
def test_the_draft_is_not_offloaded_unless_asked(monkeypatch, tmp_path, layers, want):
    import duo_vllm.draft.backend as backend_mod

    fake = FakeLlamaCpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setattr(backend_mod, "_install_log_filter", lambda lib: None)
    model = tmp_path / "draft.gguf"
    model.write_bytes(b"GGUF")
    backend_mod.LlamaCppBackend(str(model), n_ctx=64, n_seq=1, n_threads=1,
                                n_gpu_layers=layers)
    assert fake.model_params.n_gpu_layers == want
    # with no layers on the GPU, prefill batches stay off it too (llama.cpp's op offload:
    # 3x slower than the CPU beside a busy target, benchmarks/README.md)
    assert fake.context_params.op_offload == (layers != 0)


def test_the_actor_hides_the_gpus_unless_the_draft_may_use_them():
    opts = actor_options(DuoConfig())
    assert opts["runtime_env"]["env_vars"] == NO_GPU_ENV
    assert opts["runtime_env"]["env_vars"]["CUDA_VISIBLE_DEVICES"] == ""
    assert "runtime_env" not in actor_options(DuoConfig(draft_gpu_layers=-1))
    assert opts["name"] == "duo_vllm_draft" and opts["get_if_exists"]


def test_draft_gpu_layers_is_validated():
    with pytest.raises(DuoConfigError, match="draft_gpu_layers"):
        DuoConfig(draft_gpu_layers=-2)
    with pytest.raises(DuoConfigError, match="draft_gpu_layers"):
        DuoConfig(draft_gpu_layers=True)


@pytest.mark.parametrize("tp_rank, last_pp", [(1, True), (3, True), (0, False)])
def test_ranks_whose_drafts_vllm_drops_never_touch_ray(monkeypatch, tp_rank, last_pp):
    pytest.importorskip("vllm")
    import numpy as np

    from duo_vllm.vllm import proposer as proposer_mod
    from duo_vllm.vllm import draft_side as draft_side_mod

    fake_groups(monkeypatch, tp_rank, last_pp)

    def no_ray(cfg, cores=None):
        raise AssertionError("a rank without drafts started Ray")
    monkeypatch.setattr(draft_side_mod, "_ensure_ray", no_ray)
    p = proposer_mod.DuoProposer(spec_config())
    assert p._client is None and p._worker is None
    ids = np.zeros((2, 8), dtype=np.int32)
    assert p.propose([[1], [2]], np.array([3, 3]), ids) == [[], []]
    assert "actor_restarts" in p.stats()


def test_the_output_rank_drafts_and_each_data_parallel_replica_has_its_own_actor(monkeypatch):
    pytest.importorskip("vllm")
    from duo_vllm.vllm.rows import parallel_role

    fake_groups(monkeypatch, 0)
    assert parallel_role(spec_config()) == (True, 0)
    assert parallel_role(spec_config(dp_rank=2)) == (True, 2)
    fake_groups(monkeypatch, 1)
    assert parallel_role(spec_config()) == (False, 0)


def test_a_data_parallel_replica_names_its_actor(monkeypatch):
    pytest.importorskip("vllm")
    from duo_vllm.vllm import proposer as proposer_mod
    from duo_vllm.vllm import draft_side as draft_side_mod

    fake_groups(monkeypatch, 0)
    seen = {}

    class Stop(Exception):
        pass

    def capture(cfg, cores=None):  # the first Ray call: the actor's name is settled by then
        seen["name"] = cfg.actor_name
        raise Stop
    monkeypatch.setattr(draft_side_mod, "_ensure_ray", capture)
    monkeypatch.setattr(proposer_mod.DuoProposer, "_draft_cores", staticmethod(lambda cfg: [0]))
    with pytest.raises(Stop):
        proposer_mod.DuoProposer(spec_config(dp_rank=2))
    assert seen["name"] == "duo_vllm_draft_dp2"
