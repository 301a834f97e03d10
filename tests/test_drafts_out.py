"""The step's drafts ride on its output (duo_vllm/vllm/drafts_out.py): a fake executor and
runner count the worker calls that vLLM's engine core makes."""

import pickle
from concurrent.futures import Future

from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput

from duo_vllm.vllm.drafts_out import attach_drafts, with_drafts_from_output


def output(req_ids=("a",)):
    return ModelRunnerOutput(req_ids=list(req_ids),
                             req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[[7] for _ in req_ids])


class FakeRunner:
    """sample_tokens returns ``out``; the drafts are ``drafts`` until changed."""

    def __init__(self, out=None):
        self.out = out
        self.drafts = DraftTokenIds(["a"], [[1, 2, 3]])

    def sample_tokens(self, grammar_output):
        return self.out if self.out is not None else output()

    def take_draft_token_ids(self):
        return self.drafts


class FakeExecutor:
    """The worker behind a message queue: every call is counted; ``non_block`` gives a
    Future, as vLLM's multiprocess executor does."""

    def __init__(self, runner):
        self.runner, self.worker_calls = runner, []

    def execute_model(self, scheduler_output, non_block=False):
        self.worker_calls.append("execute_model")
        return None

    def sample_tokens(self, grammar_output, non_block=False):
        self.worker_calls.append("sample_tokens")
        out = pickle.loads(pickle.dumps(self.runner.sample_tokens(grammar_output)))
        if non_block:
            fut = Future()
            fut.set_result(out)
            return fut
        return out

    def take_draft_token_ids(self):
        self.worker_calls.append("take_draft_token_ids")
        return self.runner.take_draft_token_ids()


def step(executor, non_block=False):
    """EngineCore.step then post_step, as vLLM 0.32 runs them without async scheduling."""
    executor.execute_model(None)
    out = executor.sample_tokens(None, non_block)
    return out, executor.take_draft_token_ids()


def engine(runner):
    class Executor(FakeExecutor):
        pass

    assert with_drafts_from_output(Executor)
    assert not with_drafts_from_output(Executor)  # once
    return Executor(runner)


def test_carried_drafts_spare_the_engine_core_its_second_call():
    runner = FakeRunner()
    assert attach_drafts(runner) and not attach_drafts(runner)
    executor = engine(runner)
    _, drafts = step(executor)
    assert drafts.req_ids == ["a"] and drafts.draft_token_ids == [[1, 2, 3]]
    assert executor.worker_calls == ["execute_model", "sample_tokens"]  # no third call
    runner.drafts = DraftTokenIds(["a"], [[4]])  # the next step's drafts, not the last's
    assert step(executor)[1].draft_token_ids == [[4]]
    runner.drafts = None  # a step without drafts carries that too
    assert step(executor)[1] is None
    assert executor.worker_calls.count("take_draft_token_ids") == 0


def test_without_carried_drafts_the_engine_core_asks_the_worker():
    executor = engine(FakeRunner())  # a runner without DuoProposer: nothing carried
    assert step(executor)[1].draft_token_ids == [[1, 2, 3]]
    assert executor.worker_calls == ["execute_model", "sample_tokens", "take_draft_token_ids"]


def test_a_future_or_a_step_without_sampling_never_reuses_the_last_drafts():
    runner = FakeRunner()
    attach_drafts(runner)
    executor = engine(runner)
    step(executor)
    out, drafts = step(executor, non_block=True)  # pipeline parallelism: a Future
    assert isinstance(out, Future) and executor.worker_calls[-1] == "take_draft_token_ids"
    executor.sample_tokens(None)  # carried, but the next step samples nothing ...
    executor.execute_model(None)
    runner.drafts = DraftTokenIds(["a"], [[9]])
    assert executor.take_draft_token_ids().draft_token_ids == [[9]]  # ... so it asks


def test_the_shared_empty_output_is_left_alone():
    runner = FakeRunner(out=EMPTY_MODEL_RUNNER_OUTPUT)
    attach_drafts(runner)
    assert runner.sample_tokens(None) is EMPTY_MODEL_RUNNER_OUTPUT
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, "_duo_drafts")
