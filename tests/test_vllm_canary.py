"""Canaries: the private vLLM APIs duo_vllm relies on, read from the installed vLLM.

Each test names one thing DuoProposer or duo_vllm.vllm.patches reads or
wraps, and checks it in the installed vLLM's classes and source (inspect,
ast, small objects; no engine, no model). After a vLLM upgrade a failure
here says which assumption broke, where otherwise the plugin would quietly
lose its hook, its sampling settings or its kernel fix.
"""

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")
gmr = pytest.importorskip("vllm.v1.worker.gpu_model_runner")

from duo_vllm.vllm import checks as vllm_checks  # noqa: E402
from duo_vllm.vllm import patches as vllm_patches  # noqa: E402
from duo_vllm.vllm.proposer import DuoProposer  # noqa: E402


def _source_tree(obj):
    return ast.parse(textwrap.dedent(inspect.getsource(obj)))


def _custom_class_branches(tree):
    """Bodies of ``if/elif <x>.method == "custom_class":`` branches in ``tree``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
            continue
        test = node.test
        if (isinstance(test.left, ast.Attribute) and test.left.attr == "method"
                and any(isinstance(c, ast.Constant) and c.value == "custom_class"
                        for c in test.comparators)):
            yield node.body


def _calls(nodes, attr):
    """Calls of ``<something>.<attr>(...)`` under ``nodes``."""
    for stmt in nodes:
        for node in ast.walk(stmt):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == attr):
                yield node


def test_installed_vllm_is_a_supported_version():
    import vllm

    assert vllm_checks.vllm_release(vllm.__version__) in vllm_checks.SUPPORTED_VLLM, (
        f"vLLM {vllm.__version__} is not in duo_vllm.vllm.checks.SUPPORTED_VLLM: check "
        "every canary here, then add it there and to setup.py's 'gpu' extra")


def test_setup_pins_the_supported_versions():
    tree = ast.parse((Path(__file__).resolve().parents[1] / "setup.py").read_text())
    extras = next(kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                  for kw in node.keywords if kw.arg == "extras_require")
    extras = ast.literal_eval(extras)
    (pin,) = [r for r in extras["gpu"] if r.startswith("vllm")]
    low, high = re.fullmatch(r"vllm>=(\d+\.\d+),<(\d+\.\d+)", pin).groups()
    supported = sorted(vllm_checks.SUPPORTED_VLLM)
    assert low == "%d.%d" % supported[0]
    assert high == "%d.%d" % (supported[-1][0], supported[-1][1] + 1)


def test_update_states_exists_on_v1_runner_and_its_result_is_kept():
    update = inspect.unwrap(gmr.GPUModelRunner._update_states)  # ours may be installed
    assert list(inspect.signature(update).parameters) == ["self", "scheduler_output"]
    # execute_model calls it once per step and keeps what it returns (a deferred
    # corrections callable in 0.32-0.33): the hook must run there, and pass it through
    kept = [node for node in ast.walk(_source_tree(gmr.GPUModelRunner.execute_model))
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == "_update_states"]
    assert len(kept) == 1 and [ast.unparse(a) for a in kept[0].value.args] == [
        "scheduler_output"]


def test_cpu_runner_is_v1_and_inherits_update_states():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert issubclass(CPUModelRunner, gmr.GPUModelRunner)
    assert "_update_states" not in vars(CPUModelRunner)  # else the hook never runs on CPU


def test_custom_proposer_is_built_in_the_runners_init_as_runner_drafter():
    branches = list(_custom_class_branches(_source_tree(gmr.GPUModelRunner.__init__)))
    assert branches, "GPUModelRunner.__init__ no longer builds custom_class proposers"
    targets = [ast.unparse(t) for body in branches for stmt in body
               if isinstance(stmt, ast.Assign) for t in stmt.targets]
    assert targets == ["self.drafter"]


class Probe:
    """A stand-in custom proposer class for vLLM's loader."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None):
        return [[] for _ in sampled_token_ids]

    def on_new_requests(self, new_reqs, batch=None):
        pass


def test_custom_proposer_loader_gives_a_proposer_the_hook_finds():
    from vllm.v1.spec_decode import custom_class_proposer as ccp

    path = f"{__name__}.Probe"
    spec = SimpleNamespace(model=path, custom_proposer_backend=path,
                           num_speculative_tokens=4)
    config = SimpleNamespace(speculative_config=spec,
                             model_config=SimpleNamespace(max_model_len=64))
    if hasattr(ccp, "create_custom_proposer"):  # vLLM 0.32-0.33: the class itself
        drafter = ccp.create_custom_proposer(config)
    else:  # a wrapper that keeps the class as user_proposer
        drafter = ccp.CustomClassProposer(config)
    runner = SimpleNamespace(drafter=drafter)
    found = vllm_patches.find_proposer(runner)
    assert isinstance(found, Probe) and found.vllm_config is config


def test_propose_is_called_as_duo_proposer_takes_it():
    """The custom_class branch's ``propose`` call, argument for argument."""
    calls = [call for body in _custom_class_branches(_source_tree(gmr))
             for call in _calls(body, "propose")]
    assert len(calls) == 1, "expected one custom_class propose() call in gpu_model_runner"
    (call,) = calls
    args = [ast.unparse(a) for a in call.args]
    kwargs = {k.arg: ast.unparse(k.value) for k in call.keywords}
    assert args == ["sampled_token_ids", "self.input_batch.num_tokens_no_spec",
                    "self.input_batch.token_ids_cpu"]
    assert kwargs == {"slot_mappings": "slot_mappings"}
    inspect.signature(DuoProposer.propose).bind(None, *args, **kwargs)
    # a wrapping vLLM (user_proposer) passes the same four by keyword
    inspect.signature(DuoProposer.propose).bind(
        None, sampled_token_ids=0, num_tokens_no_spec=0, token_ids_cpu=0, slot_mappings=0)


def test_input_batch_has_what_the_proposer_reads(monkeypatch):
    """token_ids_cpu (a numpy array), num_tokens_no_spec, req_ids, temperature_cpu."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.worker import gpu_input_batch
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    # CUDA vLLM without a GPU (the upstream lane) would pin host memory: no driver to ask
    monkeypatch.setattr(gpu_input_batch, "PIN_MEMORY", False)

    batch = InputBatch(max_num_reqs=2, max_model_len=16, max_num_batched_tokens=32,
                       device=torch.device("cpu"), vocab_size=100, block_sizes=[16],
                       max_num_blocks_per_req=[1])
    # a numpy array in 0.32-0.33; the proposer takes a CPU tensor too (np.asarray)
    assert isinstance(batch.token_ids_cpu, np.ndarray) or (
        isinstance(batch.token_ids_cpu, torch.Tensor) and batch.token_ids_cpu.device.type == "cpu")
    for req_id, temperature in (("a", 0.7), ("b", 0.0)):
        batch.add_request(CachedRequestState(
            req_id=req_id, prompt_token_ids=[1, 2, 3], mm_features=[],
            sampling_params=SamplingParams(temperature=temperature, max_tokens=4),
            generator=None, block_ids=([0],), num_computed_tokens=0, output_token_ids=[5]))
    tokens = np.asarray(batch.token_ids_cpu)
    assert tokens.shape == (2, 16) and tokens.dtype.kind == "i"
    assert tokens[:, :4].tolist() == [[1, 2, 3, 5]] * 2
    assert list(batch.num_tokens_no_spec[:2]) == [4, 4]
    assert batch.req_ids == ["a", "b"]
    assert batch.temperature_cpu[:2].tolist() == pytest.approx([0.7, 0.0])


def test_scheduler_output_carries_new_requests_with_prompts():
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    # the hook reads both: the new prompts, and the step's scheduled requests (its batch)
    assert {"scheduled_new_reqs", "num_scheduled_tokens"} <= {
        f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {"req_id", "prompt_token_ids"} <= {f.name for f in dataclasses.fields(NewRequestData)}


def test_speculative_config_takes_duo_proposer_and_carries_its_options():
    from vllm.config import LoadConfig, SpeculativeConfig

    assert SpeculativeConfig._is_custom_proposer_path("duo_vllm.DuoProposer")
    assert "draft_load_config" in {f.name for f in dataclasses.fields(SpeculativeConfig)}
    assert LoadConfig(model_loader_extra_config={"duo": {"k": 1}}).model_loader_extra_config == {
        "duo": {"k": 1}}


def test_custom_proposers_fall_back_to_v1_and_v2_is_switched_by_its_env_var():
    import vllm.envs as envs
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    assert vllm_checks.V2_ENV in envs.environment_variables  # our error message names it
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(distributed_executor_backend="mp",
                                        pipeline_parallel_size=1, use_ubatching=False),
        speculative_config=SimpleNamespace(method="custom_class", parallel_drafting=False,
                                           use_heterogeneous_vocab=False))
    unsupported = VllmConfig._get_v2_model_runner_unsupported_features(config)
    assert "speculative method 'custom_class'" in unsupported
    # V2 is a class of its own: check_model_runner tells it from V1 by isinstance
    assert not issubclass(V2Runner, gmr.GPUModelRunner)


def test_kernel_registry_and_override_as_the_cpu_fix_uses_them(monkeypatch):
    from vllm.triton_utils import dispatcher
    import vllm.v1.sample.rejection_sampler as rs

    assert isinstance(dispatcher._registry, dict)
    host, attr = dispatcher._resolve_kernel(vllm_patches.EXPAND_KERNEL)
    assert host is rs and attr == "expand_kernel"
    for name, entry in dispatcher._registry.items():
        assert isinstance(name, str) and len(entry) == 2  # (original kernel, impl)

    def old_impl(*args):
        return "old"

    def new_impl(*args):
        return "new"

    override = dispatcher.KernelOverride(rs.expand_kernel, old_impl)
    monkeypatch.setattr(rs, "expand_kernel", override)
    monkeypatch.setitem(dispatcher._registry, vllm_patches.EXPAND_KERNEL,
                        (override, old_impl))
    assert vllm_patches.route_expand_kernel(new_impl)
    assert override[(1,)](1, 2) == "new" and override(1, 2) == "new"  # launch and call
    assert dispatcher._registry[vllm_patches.EXPAND_KERNEL][1] is new_impl


def test_cpu_platform_registers_the_expand_override_that_the_fix_replaces():
    cpu_tl = pytest.importorskip("vllm.utils.cpu_triton_utils")
    from vllm.platforms.cpu import CpuPlatform

    assert callable(cpu_tl._expand_kernel_impl)
    assert f'"{vllm_patches.EXPAND_KERNEL}"' in inspect.getsource(
        CpuPlatform.register_triton_kernel_overrides)


def test_parallel_groups_name_the_output_rank():
    from vllm.distributed import parallel_state as ps

    assert callable(ps.get_tp_group) and callable(ps.get_pp_group)
    assert isinstance(inspect.getattr_static(ps.GroupCoordinator, "is_last_rank"), property)
    assert "self.rank_in_group" in inspect.getsource(ps.GroupCoordinator.__init__)


def test_the_runner_reads_draft_probs_by_request_as_the_draft_probs_hook_sets_them():
    # the rejection sampler gets _get_spec_decode_draft_probs(...) from _sample
    sample = _source_tree(inspect.unwrap(gmr.GPUModelRunner._sample))
    assert any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr == "_get_spec_decode_draft_probs" for n in ast.walk(sample))
    # ... which slices self._draft_probs[row, :num_draft] by self._draft_prob_req_ids
    src = inspect.getsource(gmr.GPUModelRunner._get_spec_decode_draft_probs)
    assert "self._draft_probs[row_idx, :num_draft]" in src
    assert "self._draft_prob_req_ids" in src
    # propose_draft_token_ids clears both before asking the proposer: the hook sets them after
    propose = inspect.getsource(inspect.unwrap(gmr.GPUModelRunner.propose_draft_token_ids))
    assert propose.index("self._draft_probs = None") < propose.index('"custom_class"')
    assert list(inspect.signature(inspect.unwrap(gmr.GPUModelRunner._sample)).parameters)[:2] \
        == ["self", "logits"]


def test_the_runner_keeps_each_requests_sampling_params_where_the_proposer_reads_them():
    # DuoProposer._draw_temperatures: runner.requests[req_id].sampling_params.structured_outputs
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    init = inspect.getsource(gmr.GPUModelRunner.__init__)
    assert re.search(r"self\.requests\s*:\s*dict\[str, CachedRequestState\]", init)
    assert "sampling_params" in {f.name for f in dataclasses.fields(CachedRequestState)}
    assert SamplingParams(temperature=0.7).structured_outputs is None


def test_prepare_inputs_has_a_plain_branch_the_draft_free_hook_takes():
    # the draft-free hook shadows self.speculative_config for one _prepare_inputs call: the
    # method reads it once, to pick between the plain branch (no spec metadata, one logits
    # row per request) and the speculative one
    src = inspect.getsource(inspect.unwrap(gmr.GPUModelRunner._prepare_inputs))
    assert src.count("speculative_config") == 1
    assert "use_spec_decode = self.speculative_config is not None" in src
    plain = src[src.index("if not use_spec_decode:"):src.index("else:", src.index(
        "if not use_spec_decode:"))]
    assert "logits_indices = query_start_loc[1:] - 1" in plain
    assert "spec_decode_metadata = None" in plain
    # _sample(self, logits, spec_decode_metadata) calls self.sampler(...) for None
    params = list(inspect.signature(inspect.unwrap(gmr.GPUModelRunner._sample)).parameters)
    assert params[:3] == ["self", "logits", "spec_decode_metadata"]
    sample = inspect.getsource(inspect.unwrap(gmr.GPUModelRunner._sample))
    assert "if spec_decode_metadata is None:" in sample and "self.sampler(" in sample
    # vLLM lists a request's drafts only where it has some; hybrid models are known as such
    from vllm.config import ModelConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert "scheduled_spec_decode_tokens" in {f.name for f in
                                              dataclasses.fields(SchedulerOutput)}
    assert isinstance(inspect.getattr_static(ModelConfig, "is_hybrid"),
                      (property, functools.cached_property))
    for name in ("_prepare_inputs", "_sample"):  # the CPU runner runs the V1 runner's
        assert name not in vars(CPUModelRunner)


def _called_names(obj) -> set[str]:
    """Dotted names of the calls in ``obj``'s source (``self.model_executor.x``)."""
    return {ast.unparse(node.func) for node in ast.walk(_source_tree(obj))
            if isinstance(node, ast.Call)}


def test_the_engine_core_asks_the_worker_for_the_drafts_after_each_step():
    from vllm.v1.engine.core import EngineCore

    # vLLM's own path carries DuoProposer's drafts: post_step -> take_draft_token_ids
    assert "self.model_executor.take_draft_token_ids" in _called_names(EngineCore.post_step)


def test_the_rejection_sampler_keeps_logits_copies_for_logprobs_only():
    """What logprob_free_verify skips: the bonus call's ``max_num_logprobs=-1`` and the
    target logits' clone, both read only where the step asks for logprobs."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    src = inspect.getsource(getattr(RejectionSampler.forward, "__wrapped__",
                                    RejectionSampler.forward))
    assert "max_num_logprobs=-1" in src and "predict_bonus_token=True" in src
    assert re.search(r"if not self\.is_processed_logprobs_mode:\s*\n(\s*#.*\n)*\s*"
                     r"target_logits = target_logits\.clone\(\)", src)
    assert re.search(r"if sampling_metadata\.max_num_logprobs is not None:\s*\n\s*"
                     r"logprobs_tensors = self\._get_logprobs_tensors\(", src)
    forward = getattr(Sampler.forward, "__wrapped__", Sampler.forward)
    assert list(inspect.signature(forward).parameters)[:4] == [
        "self", "logits", "sampling_metadata", "predict_bonus_token"]
