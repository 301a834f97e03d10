"""Bad DuoProposer setups stop vLLM at start-up with a message that says what to fix.

A real start-up shows that the proposer's errors reach the user through vLLM;
the other messages (a vocabulary mismatch, a malformed $DUO_VLLM_CONFIG, bad
values of every option, nonexistent cores, a corrupt GGUF) take the same path
and are checked without a vLLM start-up (tests/test_proposer.py,
tests/test_config.py, tests/test_cli.py).
"""

import pytest

from duo_vllm.cli import speculative_config
from tests.support.engines import run_vllm

pytestmark = pytest.mark.e2e


def test_bad_draft_path_fails_at_startup(session_tmp, target_dir):
    out = run_vllm(session_tmp, "bad_path", expect_failure=True, target=target_dir,
                   prompts=["hi"], max_tokens=4, timeout=300,
                   speculative_config=speculative_config(4, {"draft_model": "/nope/draft.gguf"}))
    assert "DuoProposer draft_model '/nope/draft.gguf' does not exist" in out["log"]

