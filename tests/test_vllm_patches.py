"""The vLLM fixes in duo_vllm.vllm_patches: the bug exists, and the fix is right."""

import pytest
import torch

from duo_vllm.vllm_patches import expand_kernel_impl


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
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    x, cu, out = expand_case(torch.float32)
    cpu_tl._expand_kernel_impl(out, x, cu, -1, 1)  # as vLLM calls it for temperature
    # the bug this fix exists for: nothing was written
    assert out.tolist() == [42.0] * 6

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the override only exists on vLLM's CPU platform")
    current_platform.register_triton_kernel_overrides()
    from duo_vllm.vllm_patches import fix_cpu_expand_kernel
    from vllm.v1.sample import rejection_sampler as rs

    assert fix_cpu_expand_kernel()
    x, cu, _ = expand_case(torch.float32)
    got = rs.expand_batch_to_tokens(x, cu, 6, replace_from=-1, replace_to=1)
    assert got.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])
    assert not fix_cpu_expand_kernel()  # idempotent
