import pytest

from tests.support.engines import run_vllm
from tests.support.swallowed import SwallowedExceptions


def pytest_configure(config):
    config.addinivalue_line("markers", "e2e: runs real vLLM with the real default models")
    config.addinivalue_line(
        "markers", "expect_swallowed(*types, reason): the test injects failures that the "
        "product catches and logs, of these exception types (none given: any)")


@pytest.fixture(autouse=True)
def swallowed(request):
    """Fails a test whose product code caught and logged an exception the test did not
    expect (tests/support/swallowed.py): a fake's assert inside the drafter's or the
    proposer's ``except Exception``, say. Tests that inject failures say so with
    ``@pytest.mark.expect_swallowed(RuntimeError, reason="...")`` (``reason`` is needed
    with a single type: pytest would take a lone class for the thing to mark); a test
    may read ``swallowed.exceptions``."""
    catcher = SwallowedExceptions()
    with catcher.attached():
        yield catcher
    marker = request.node.get_closest_marker("expect_swallowed")
    allowed = () if marker is None else (tuple(marker.args) or (BaseException,))
    found = catcher.unexpected(allowed)
    if found:
        pytest.fail(catcher.report(found), pytrace=False)


@pytest.fixture
def clock(monkeypatch):
    """The proposer's time, moved by hand: ``clock.now += 0.05`` (proposer-step tests)."""
    from tests.support.proposer_steps import hand_clock

    return hand_clock(monkeypatch)


@pytest.fixture(scope="session")
def target_dir():
    from duo_vllm.models import prepare_default_target

    return prepare_default_target()


@pytest.fixture(scope="session")
def tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


@pytest.fixture(scope="session")
def specbench_chat(tokenizer):
    """Ten Spec-Bench prompts, two per task, in the target's chat format."""
    from tests.support.specbench import chat_prompts, load_specbench

    pairs = load_specbench(per_task=2)
    return chat_prompts(tokenizer, [p for _, p in pairs])


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def plain_greedy(session_tmp, target_dir, specbench_chat):
    """Plain vLLM's greedy output on the ten prompts: the reference; then four of them at
    once, each step's calls traced (what a draft-free speculative step must match)."""
    return run_vllm(session_tmp, "plain", target=target_dir, prompts=specbench_chat,
                    max_tokens=64, speculative_config=None,
                    then_batched=specbench_chat[:4], trace=True)
