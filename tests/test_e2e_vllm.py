"""End to end: real vLLM (CPU), the real default models, the real Ray draft actor."""

import pytest

from duo_vllm.cli import speculative_config
from tests.conftest import run_vllm

pytestmark = pytest.mark.e2e


def test_greedy_output_equals_plain_vllm(session_tmp, target_dir, specbench_chat, plain_greedy):
    duo = run_vllm(session_tmp, "duo", target=target_dir, prompts=specbench_chat,
                   max_tokens=64, speculative_config=speculative_config(4))
    assert len(specbench_chat) >= 10
    for i, (want, got) in enumerate(zip(plain_greedy["token_ids"], duo["token_ids"])):
        assert got == want, f"prompt {i}: DuoProposer output differs from plain vLLM"
    m = duo["metrics"]
    assert m["proposed"] > 0 and m["accepted"] > 0, m
    # the draft ran in the Ray actor, pinned to core 1, next to a target on core 0
    assert "DuoProposer: draft" in duo["log"] and "cores [1]" in duo["log"], duo["log"][-3000:]
    stats = duo["draft_stats"]
    assert stats["drafted_tokens"] >= m["proposed"], stats
    # per-request state: context tokens are reused, not re-prefilled every step
    assert stats["reused_tokens"] > 5 * stats["prefill_tokens"], stats
