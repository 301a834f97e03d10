"""The vLLM fixes in duo_vllm.vllm.patches: the bug exists, and the fix is right."""

import pytest
import torch

from duo_vllm.vllm.patches import expand_kernel_impl
from tests.support.vllm_metadata import sampling_metadata, spec_metadata


def needs_vllm_cpu(what: str) -> None:
    """Skip unless vLLM is the CPU build: ``what`` exists only there (on CUDA vLLM, as in
    the upstream lane, Triton runs these kernels, and only on a GPU)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip(f"needs vLLM-CPU's {what}; this vLLM's platform is "
                    f"{type(current_platform).__name__}")


REJECTION_KERNELS = "CPU rejection-sampler kernels (CpuPlatform.register_triton_kernel_overrides)"


def expand_case(dtype):
    x = torch.tensor([0.7, -1.0, 1.3], dtype=dtype)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = torch.full((6,), 42.0, dtype=dtype)
    return x, cu, out


def test_fixed_expand_matches_the_kernel_contract():
    x, cu, out = expand_case(torch.float32)
    expand_kernel_impl(out, x, cu, -1.0, 1.0)  # as for temperature: greedy -1 -> 1
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])
    k = torch.tensor([5, 0, 9], dtype=torch.int32)
    out_k = torch.zeros(6, dtype=torch.int32)
    expand_kernel_impl(out_k, k, cu, 0, 0)
    assert out_k.tolist() == [5, 5, 0, 0, 0, 9]


def test_vllm_cpu_expand_drops_its_output_and_the_fix_is_installed():
    cpu_tl = pytest.importorskip("vllm.utils.cpu_triton_utils")
    needs_vllm_cpu("torch.ops._C.expand_kernel_impl")
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm.platforms import current_platform

    x, cu, out = expand_case(torch.float32)
    cpu_tl._expand_kernel_impl(out, x, cu, -1, 1)  # as vLLM calls it for temperature
    # the bug this fix exists for: nothing was written
    assert out.tolist() == [42.0] * 6

    current_platform.register_triton_kernel_overrides()
    from duo_vllm.vllm.patches import fix_cpu_expand_kernel
    from vllm.v1.sample import rejection_sampler as rs

    assert fix_cpu_expand_kernel()
    x, cu, _ = expand_case(torch.float32)
    got = rs.expand_batch_to_tokens(x, cu, 6, replace_from=-1, replace_to=1)
    assert got.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])
    assert not fix_cpu_expand_kernel()  # idempotent


def test_expand_fix_applies_on_the_cpu_platform_only(monkeypatch):
    cpu_tl = pytest.importorskip("vllm.utils.cpu_triton_utils")
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    from duo_vllm.vllm.patches import EXPAND_KERNEL, fix_cpu_expand_kernel

    entry = dispatcher._registry.get(EXPAND_KERNEL) or (None, None)
    # the broken CPU override in place, on a platform that says it is not the CPU (a GPU)
    monkeypatch.setitem(dispatcher._registry, EXPAND_KERNEL,
                        (entry[0], cpu_tl._expand_kernel_impl))
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert not fix_cpu_expand_kernel()
    assert dispatcher._registry[EXPAND_KERNEL][1] is cpu_tl._expand_kernel_impl


@pytest.mark.expect_swallowed(RuntimeError, reason="the hook's injected failure")
def test_new_request_hook_tells_the_drafter_before_the_step_and_never_breaks_it(caplog):
    from types import SimpleNamespace

    from duo_vllm.vllm.patches import with_new_request_hook

    calls = []

    class Runner:
        def __init__(self, drafter):
            self.drafter = drafter

        def _update_states(self, scheduler_output):
            calls.append(("update", len(scheduler_output.scheduled_new_reqs)))
            return "deferred"

    Runner._update_states = with_new_request_hook(Runner._update_states)
    assert with_new_request_hook(Runner._update_states) is Runner._update_states  # idempotent

    class Drafter:
        def on_new_requests(self, reqs, batch=None):
            calls.append(("hook", [r.prompt_token_ids for r in reqs], batch))

    new = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(prompt_token_ids=[1, 2, 3])],
                          num_scheduled_tokens={"a": 3, "b": 1})  # one running, one new
    assert Runner(Drafter())._update_states(new) == "deferred"
    assert calls == [("hook", [[1, 2, 3]], 2), ("update", 1)]  # the hook runs first

    calls.clear()
    Runner(Drafter())._update_states(SimpleNamespace(scheduled_new_reqs=[]))
    Runner(object())._update_states(new)  # a drafter without the hook (ngram, say)
    assert calls == [("update", 0), ("update", 1)]

    class Lending(Drafter):  # told every step's token rows and prompt tokens
        def before_step(self, tokens, prefill=0):
            calls.append(("before", tokens, prefill))

    calls.clear()
    Runner(Lending())._update_states(SimpleNamespace(**vars(new), total_num_scheduled_tokens=4))
    Runner(Lending())._update_states(SimpleNamespace(  # two requests, 3 draft tokens each
        scheduled_new_reqs=[], total_num_scheduled_tokens=8, num_scheduled_tokens={"a": 4, "b": 4},
        scheduled_spec_decode_tokens={"a": [5, 6, 7], "b": [8, 9, 10]}))
    assert calls == [("hook", [[1, 2, 3]], 2), ("before", 4, 2), ("update", 1),
                     ("before", 8, 0), ("update", 0)]

    class Broken:
        def on_new_requests(self, reqs, batch=None):
            raise RuntimeError("boom")

    calls.clear()
    assert Runner(Broken())._update_states(new) == "deferred"
    assert calls == [("update", 1)] and "new-request hook failed" in caplog.text


def test_new_request_hook_installs_on_vllms_model_runner():
    gmr = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
    from duo_vllm.vllm.patches import NEW_REQUEST_HOOK, install_new_request_hook

    assert install_new_request_hook() and install_new_request_hook()
    wrapped = gmr.GPUModelRunner._update_states
    assert getattr(wrapped, NEW_REQUEST_HOOK) and not getattr(wrapped.__wrapped__,
                                                              NEW_REQUEST_HOOK, False)


class WrappedRunner:
    """A model runner whose drafter is a vLLM wrapper around the custom class."""

    def __init__(self, drafter):
        self.drafter = drafter

    def _update_states(self, scheduler_output):
        return lambda: "deferred corrections"


def test_new_request_hook_finds_a_proposer_that_vllm_wraps():
    from types import SimpleNamespace

    from duo_vllm.vllm.patches import with_new_request_hook

    seen = []

    class Proposer:
        _runner = None

        def attach_runner(self, runner):
            self._runner = runner

        def on_new_requests(self, reqs, batch=None):
            seen.append(len(reqs))

    class Runner(WrappedRunner):
        _update_states = with_new_request_hook(WrappedRunner._update_states)

    proposer = Proposer()
    runner = Runner(SimpleNamespace(user_proposer=proposer, propose=lambda *a, **k: []))
    deferred = runner._update_states(SimpleNamespace(scheduled_new_reqs=["r"]))
    assert deferred() == "deferred corrections"  # the wrapped method's result passes through
    assert seen == [1] and proposer._runner is runner


def test_new_request_hook_says_when_it_finds_no_proposer(caplog):
    from types import SimpleNamespace

    from duo_vllm.vllm.patches import with_new_request_hook

    class Runner(WrappedRunner):
        _update_states = with_new_request_hook(WrappedRunner._update_states)

    class Wrapper:  # a wrapper that keeps the proposer under a name we do not know
        def __init__(self):
            self.inner = object()

    runner = Runner(Wrapper())
    new = SimpleNamespace(scheduled_new_reqs=["r"])
    assert runner._update_states(new)() == "deferred corrections"
    runner._update_states(new)
    missing = [r for r in caplog.records if "finds no proposer" in r.getMessage()]
    assert len(missing) == 1 and "Wrapper" in missing[0].getMessage()  # once per runner
    caplog.clear()
    Runner(None)._update_states(new)  # no drafter at all (a rank without one): nothing to say
    assert "finds no proposer" not in caplog.text


def test_new_request_hook_reports_a_runner_that_bypasses_it(caplog):
    gmr = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
    from duo_vllm.vllm.patches import install_new_request_hook

    class BypassingModelRunner(gmr.GPUModelRunner):
        def __init__(self):  # vLLM builds the proposer here; the proposer installs the hook
            self.hooked = install_new_request_hook()

        def _update_states(self, scheduler_output):
            return None

    class InheritingModelRunner(gmr.GPUModelRunner):
        def __init__(self):
            self.hooked = install_new_request_hook()

    assert not BypassingModelRunner().hooked
    assert "overrides _update_states" in caplog.text and "BypassingModelRunner" in caplog.text
    assert InheritingModelRunner().hooked


def test_model_runner_check_accepts_v1_and_names_the_fix_for_v2():
    gmr = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    from duo_vllm.vllm.checks import UnsupportedVllmError, check_model_runner

    check_model_runner(object.__new__(gmr.GPUModelRunner), use_v2=False)
    check_model_runner(object.__new__(CPUModelRunner))
    check_model_runner(None, None)  # nothing known: the V1 class exists, that is all
    with pytest.raises(UnsupportedVllmError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        check_model_runner(object.__new__(V2Runner))
    with pytest.raises(UnsupportedVllmError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        check_model_runner(None, use_v2=True)

    class TPUModelRunner:  # another platform's runner, not V1's
        pass

    with pytest.raises(UnsupportedVllmError, match="supports vLLM 0.32 and 0.33"):
        check_model_runner(TPUModelRunner())


def test_model_runner_check_fails_when_v1_is_gone(monkeypatch):
    gmr = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
    from duo_vllm.vllm.checks import UnsupportedVllmError, check_model_runner

    monkeypatch.delattr(gmr.GPUModelRunner, "_update_states")
    with pytest.raises(UnsupportedVllmError, match="_update_states"):
        check_model_runner(None, None)


def test_start_up_check_finds_the_runner_that_builds_the_proposer(monkeypatch):
    pytest.importorskip("vllm.v1.worker.gpu_model_runner")
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    from duo_vllm.vllm.checks import UnsupportedVllmError, check_vllm

    VllmConfig = type("VllmConfig", (), {"__module__": "vllm.config.vllm",
                                         "use_v2_model_runner": False})

    def builds_proposer(self):  # as vLLM's runners do: self.drafter = Proposer(vllm_config)
        check_vllm(VllmConfig())

    monkeypatch.setattr(V2Runner, "__init__", builds_proposer)
    monkeypatch.setattr(CPUModelRunner, "__init__", builds_proposer)
    with pytest.raises(UnsupportedVllmError, match="this worker runs vllm.v1.worker.gpu"):
        V2Runner()
    CPUModelRunner()  # V1 (its CPU subclass): fine
    VllmConfig.use_v2_model_runner = True
    with pytest.raises(UnsupportedVllmError, match="config selects Model Runner V2"):
        check_vllm(VllmConfig())
    from types import SimpleNamespace

    check_vllm(SimpleNamespace(use_v2_model_runner=True))  # the tests' stand-in configs


def test_unknown_vllm_versions_warn(caplog):
    from duo_vllm.vllm.checks import check_vllm_version, vllm_release

    assert vllm_release("0.32.0+cpu") == (0, 32) and vllm_release("v0.33.1rc1") == (0, 33)
    assert check_vllm_version("0.32.0") and check_vllm_version("0.33.2")
    assert "untested" not in caplog.text
    assert not check_vllm_version("0.34.0.dev5")
    assert "vLLM 0.34.0.dev5 is untested" in caplog.text and "0.32 and 0.33" in caplog.text
    assert not check_vllm_version(None)


@pytest.mark.expect_swallowed(RuntimeError, reason="the proposer's injected failure")
def test_draft_probs_hook_hands_the_custom_proposers_q_to_vllm_and_drops_a_wrong_one(caplog):
    from types import SimpleNamespace

    import torch

    from duo_vllm.vllm.patches import with_draft_probs, with_draft_probs_check

    class Drafter:
        def __init__(self, probs):
            self.probs = probs

        def take_last_draft_probs(self):
            probs, self.probs = self.probs, None
            return probs

    class Runner:
        def __init__(self, drafter, method="custom_class"):
            self.drafter = drafter
            self.speculative_config = SimpleNamespace(method=method)
            self.input_batch = SimpleNamespace(req_ids=["a", "b"])
            self._draft_probs = self._draft_prob_req_ids = None

        @with_draft_probs
        def propose_draft_token_ids(self, *args):
            return [[1], [2]]

        @with_draft_probs_check
        def _sample(self, logits, spec_decode_metadata):
            return self._draft_probs

    q = torch.zeros(2, 1, 8)
    r = Runner(Drafter(q))
    assert r.propose_draft_token_ids() == [[1], [2]]
    assert r._draft_probs is q and r._draft_prob_req_ids == ["a", "b"]
    assert r._sample(torch.zeros(2, 8), None) is q  # the logits' vocabulary: kept
    with caplog.at_level("WARNING"):
        assert r._sample(torch.zeros(2, 9), None) is None  # not theirs: verified without q
    assert "columns" in caplog.text
    r = Runner(Drafter(q), method="ngram")  # another proposer's: left alone
    r.propose_draft_token_ids()
    assert r._draft_probs is None
    r = Runner(SimpleNamespace(user_proposer=Drafter(q)))  # a proposer vLLM wraps
    r.propose_draft_token_ids()
    assert r._draft_probs is q
    d = Drafter(q[:1])  # the proposer's answer covers the rows it names
    d.draft_prob_rows = [1]
    r = Runner(d)
    r.propose_draft_token_ids()
    assert r._draft_prob_req_ids == ["b"]

    class Broken(Drafter):
        def take_last_draft_probs(self):
            raise RuntimeError("boom")
    r = Runner(Broken(q))  # a failure costs this step its q, never the engine
    with caplog.at_level("ERROR"):
        assert r.propose_draft_token_ids() == [[1], [2]]
    assert r._draft_probs is None and "verifies without them" in caplog.text


def test_draft_probs_hook_installs_on_vllms_model_runner():
    gmr = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
    from duo_vllm.vllm.patches import DRAFT_PROBS_HOOK, install_draft_probs_hook

    assert install_draft_probs_hook() and install_draft_probs_hook()
    for name in ("propose_draft_token_ids", "_sample"):
        wrapped = getattr(gmr.GPUModelRunner, name)
        assert getattr(wrapped, DRAFT_PROBS_HOOK) and not getattr(wrapped.__wrapped__,
                                                                  DRAFT_PROBS_HOOK, False)


def _runner(meta, spec="spec", hybrid=False):
    from types import SimpleNamespace

    return SimpleNamespace(speculative_config=spec, input_batch=SimpleNamespace(
        sampling_metadata=meta), model_config=SimpleNamespace(is_hybrid=hybrid))


def test_draft_free_is_a_step_with_nothing_to_verify():
    from types import SimpleNamespace

    from duo_vllm.vllm.patches import draft_free

    none = SimpleNamespace(scheduled_spec_decode_tokens={})
    some = SimpleNamespace(scheduled_spec_decode_tokens={"r1": [7, 8]})
    plain = sampling_metadata([0, 0, 0])
    assert draft_free(_runner(plain), none)
    assert not draft_free(_runner(plain), some)
    assert not draft_free(_runner(plain, spec=None), none)  # plain decoding already
    assert not draft_free(_runner(plain, hybrid=True), none)  # recurrent layers
    assert not draft_free(_runner(sampling_metadata([0, 0, 0], max_num_logprobs=2)), none)
    budget = sampling_metadata([0, 0, 0])  # a request under a thinking budget
    budget.thinking_budget_state_holder = SimpleNamespace(has_tracked_requests=lambda: True)
    assert not draft_free(_runner(budget), none)
    budget.thinking_budget_state_holder = SimpleNamespace(has_tracked_requests=lambda: False)
    assert draft_free(_runner(budget), none)


def test_a_step_without_drafts_is_prepared_as_plain_decoding():
    from types import SimpleNamespace

    from duo_vllm.vllm.patches import with_draft_free_inputs

    seen = []

    class Runner:
        def __init__(self, meta):
            self.speculative_config = "spec"
            self.input_batch = SimpleNamespace(sampling_metadata=meta)
            self.model_config = SimpleNamespace(is_hybrid=False)

        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            seen.append(self.speculative_config)  # what vLLM's branch reads
            if num_scheduled_tokens is None:
                raise ValueError("boom")
            return "inputs"

    Runner._prepare_inputs = with_draft_free_inputs(Runner._prepare_inputs)
    assert with_draft_free_inputs(Runner._prepare_inputs) is Runner._prepare_inputs
    none = SimpleNamespace(scheduled_spec_decode_tokens={})
    some = SimpleNamespace(scheduled_spec_decode_tokens={"r": [3]})
    runner = Runner(sampling_metadata([0, 0]))
    assert runner._prepare_inputs(none, [1, 1]) == "inputs"
    assert runner.speculative_config == "spec"  # restored after the call
    runner._prepare_inputs(some, [2, 1])
    Runner(sampling_metadata([0, 0], max_num_logprobs=0))._prepare_inputs(none, [1, 1])
    with pytest.raises(ValueError):
        runner._prepare_inputs(none, None)
    assert runner.speculative_config == "spec"  # restored when vLLM's code raises too
    assert seen == [None, "spec", "spec", None]


@pytest.mark.parametrize("temps", [[0, 0, 0], [0.7, 1.0, 0.7], [0, 0.7, 1.3]])
def test_vllms_samplers_agree_on_a_step_without_drafts(temps):
    """What the hook relies on: with no drafts, vLLM's rejection sampler returns what
    its plain sampler draws from the same logits (greedy rows: the argmax; seeded
    sampled rows: the same draw)."""
    rs = pytest.importorskip("vllm.v1.sample.rejection_sampler")
    needs_vllm_cpu(REJECTION_KERNELS)
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from duo_vllm.vllm.patches import fix_cpu_expand_kernel

    fix_cpu_expand_kernel()
    torch.manual_seed(0)
    logits = torch.randn(len(temps), 50) * 3
    meta = SpecDecodeMetadata.make_dummy([[] for _ in temps], torch.device("cpu"))
    meta.bonus_logits_indices = torch.arange(len(temps), dtype=torch.int32)
    meta.logits_indices = meta.bonus_logits_indices.clone()
    sampler = Sampler()
    for seed in range(5):
        plain = sampler(logits.clone(), sampling_metadata(temps, seed)).sampled_token_ids
        spec = rs.RejectionSampler(sampler)(meta, None, logits.clone(),
                                            sampling_metadata(temps, seed)).sampled_token_ids
        assert spec.tolist() == plain.tolist()
        if all(t == 0 for t in temps):
            assert plain[:, 0].tolist() == logits.argmax(-1).tolist()


def test_draft_free_inputs_install_on_vllms_model_runner():
    gmr = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
    from duo_vllm.vllm.patches import DRAFT_FREE_HOOK, install_draft_free_inputs

    assert install_draft_free_inputs() and install_draft_free_inputs()  # idempotent
    assert getattr(gmr.GPUModelRunner._prepare_inputs, DRAFT_FREE_HOOK)


def _unwrapped(fn):
    from duo_vllm.vllm.patches import LOGPROB_FREE_HOOK

    while getattr(fn, LOGPROB_FREE_HOOK, False):
        fn = fn.__wrapped__
    return fn


def _cpu_rejection_kernels():
    """vLLM-CPU's kernels for the rejection sampler, as its platform registers them at
    start-up (once: a second registration would undo the expand fix), then the fix."""
    needs_vllm_cpu(REJECTION_KERNELS)
    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import dispatcher

    from duo_vllm.vllm.patches import fix_cpu_expand_kernel

    if "vllm.v1.sample.rejection_sampler.rejection_greedy_sample_kernel" not in \
            dispatcher._registry:
        CpuPlatform.register_triton_kernel_overrides()
    fix_cpu_expand_kernel()


@pytest.mark.parametrize("temps", [[0, 0, 0, 0], [0.7, 1.0, 0.7, 0.5], [0, 0.7, 0, 1.3]])
def test_verifying_without_logprobs_keeps_no_copies_and_the_same_tokens(temps, monkeypatch):
    """The rejection sampler, stock and wrapped, on a step with drafts (hand-built
    logits, seeded rows): the same tokens; wrapped, its bonus call asks for no logits
    and the target logits are not cloned."""
    rs = pytest.importorskip("vllm.v1.sample.rejection_sampler")
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from duo_vllm.vllm.patches import with_bonus_without_logprobs, with_logprob_free_verify

    _cpu_rejection_kernels()
    monkeypatch.setattr("duo_vllm.vllm.patches._armed", [True])  # past vLLM's profiling run
    torch.manual_seed(0)
    drafts = [[3, 4], [5], [7, 8, 9], [2]]
    meta = spec_metadata(drafts)
    logits = torch.randn(sum(len(d) + 1 for d in drafts), 50) * 3
    logits[0, 3] = logits[1, 4] = 30.0  # the first row's drafts are the target's argmax
    asked, clones = [], []

    def spy(forward):
        def sample(self, logits, sampling_metadata, predict_bonus_token=False, **kw):
            if predict_bonus_token:
                asked.append(sampling_metadata.max_num_logprobs)
            return forward(self, logits, sampling_metadata, predict_bonus_token, **kw)
        return sample

    # vLLM's own (earlier tests may have installed the wraps on the classes)
    stock_forward, stock_sample = (_unwrapped(rs.RejectionSampler.forward),
                                   _unwrapped(Sampler.forward))
    clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone",
                        lambda t, *a, **k: clones.append(tuple(t.shape)) or clone(t, *a, **k))
    outs = {}
    for arm, (fwd, smp) in {"stock": (stock_forward, spy(stock_sample)),
                            "wrapped": (with_logprob_free_verify(stock_forward),
                                        with_bonus_without_logprobs(spy(stock_sample)))
                            }.items():
        monkeypatch.setattr(rs.RejectionSampler, "forward", fwd)
        monkeypatch.setattr(Sampler, "forward", smp)
        asked.clear(), clones.clear()
        verifier = rs.RejectionSampler(Sampler())
        outs[arm] = [verifier(meta, None, logits.clone(), sampling_metadata(temps, seed))
                     .sampled_token_ids.tolist() for seed in range(4)]
        outs[arm + " asked"], outs[arm + " clones"] = list(asked), list(clones)
        assert not verifier.is_processed_logprobs_mode  # restored after the step
    assert outs["wrapped"] == outs["stock"]
    assert outs["stock"][0][0][:3] == [3, 4, outs["stock"][0][0][2]]  # accepted, then a bonus
    assert set(outs["stock asked"]) == {-1} and set(outs["wrapped asked"]) == {None}
    n_target = sum(len(d) for d in drafts)
    assert (n_target, 50) in outs["stock clones"]  # the target logits kept for logprobs
    assert (n_target, 50) not in outs["wrapped clones"]


def test_verifying_with_logprobs_asked_keeps_vllms_path(monkeypatch):
    rs = pytest.importorskip("vllm.v1.sample.rejection_sampler")
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from duo_vllm.vllm.patches import with_logprob_free_verify

    _cpu_rejection_kernels()
    monkeypatch.setattr("duo_vllm.vllm.patches._armed", [True])
    meta = spec_metadata([[3], [5, 6]])
    logits = torch.randn(5, 50)
    seen = []

    stock = _unwrapped(rs.RejectionSampler.forward)

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        seen.append(self.is_processed_logprobs_mode)
        return stock(self, metadata, draft_probs, logits, sampling_metadata)

    verifier = rs.RejectionSampler(Sampler())
    wrapped = with_logprob_free_verify(forward)
    out = wrapped(verifier, meta, None, logits.clone(), sampling_metadata([0, 0], None, 1))
    assert seen == [False] and out.logprobs_tensors is not None  # as vLLM computes them
    wrapped(verifier, meta, None, logits.clone(), sampling_metadata([0, 0]))
    assert seen == [False, True] and not verifier.is_processed_logprobs_mode


def test_logprob_free_verify_installs_on_vllms_samplers():
    rs = pytest.importorskip("vllm.v1.sample.rejection_sampler")
    from vllm.v1.sample.sampler import Sampler

    from duo_vllm.vllm.patches import LOGPROB_FREE_HOOK, install_logprob_free_verify

    assert install_logprob_free_verify() and install_logprob_free_verify()  # idempotent
    for wrapped in (rs.RejectionSampler.forward, Sampler.forward):
        assert getattr(wrapped, LOGPROB_FREE_HOOK) and not getattr(
            wrapped.__wrapped__, LOGPROB_FREE_HOOK, False)
