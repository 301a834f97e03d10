"""Bad DuoProposer setups stop vLLM at start-up with a message that says what to fix.

Two real start-ups show that the proposer's errors reach the user through vLLM;
the other messages (malformed $DUO_VLLM_CONFIG, bad values of every option,
nonexistent cores, a corrupt GGUF) take the same path and are checked without
a vLLM start-up (tests/test_config.py, tests/test_cli.py, tests/test_proposer.py).
"""

import pytest

from duo_vllm.cli import speculative_config
from tests.conftest import run_vllm
from tests.test_proposer import other_vocab_target  # noqa: F401  (fixture)

pytestmark = pytest.mark.e2e


def test_bad_draft_path_fails_at_startup(session_tmp, target_dir):
    out = run_vllm(session_tmp, "bad_path", expect_failure=True, target=target_dir,
                   prompts=["hi"], max_tokens=4, timeout=300,
                   speculative_config=speculative_config(4, {"draft_model": "/nope/draft.gguf"}))
    assert "DuoProposer draft_model '/nope/draft.gguf' does not exist" in out["log"]


def test_vocab_mismatch_fails_at_startup(session_tmp, other_vocab_target):  # noqa: F811
    out = run_vllm(session_tmp, "bad_vocab", expect_failure=True, target=other_vocab_target,
                   prompts=["hi"], max_tokens=4, timeout=300,
                   speculative_config=speculative_config(4))
    assert "do not share a vocabulary" in out["log"]
    assert "draft has 49152 tokens, target tokenizer has 49153" in out["log"]

