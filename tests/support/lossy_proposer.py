"""A deliberately lossy DuoProposer, the control of tests/test_distribution.py.

Loaded by vLLM as ``tests.support.lossy_proposer.LossyDuoProposer`` (the runner
puts the repository on its engine's path: tests/support/engines.py). It drafts
like DuoProposer, then sabotages verification: the rejection sampler's per-token
temperatures are all set to 0.5, so drafts are judged against a sharper
distribution than the one the target samples from.
"""

from duo_vllm.vllm.proposer import DuoProposer
from duo_vllm.vllm.patches import expand_kernel_impl, route_expand_kernel

SABOTAGED_TEMPERATURE = 0.5


def _lossy_expand(output, input_val, cu_num_tokens, replace_from, replace_to,
                  MAX_NUM_TOKENS=None):  # noqa: N803
    expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to)
    if output.is_floating_point():  # temperature and top-p; top-k is left alone
        output.clamp_(max=SABOTAGED_TEMPERATURE)


class LossyDuoProposer(DuoProposer):
    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        if not route_expand_kernel(_lossy_expand):
            raise RuntimeError("no expand_kernel override to sabotage (not vLLM-CPU?)")
