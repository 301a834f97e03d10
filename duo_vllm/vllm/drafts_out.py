"""The step's drafts ride on its output: one call less a step in vLLM's engine core.

Without async scheduling (a custom proposer turns it off) the engine core asks the worker
for the drafts in a second call after each step (``EngineCore.post_step`` ->
``take_draft_token_ids``), though the worker had them when it returned the step's output:
with the multiprocess executor (every vLLM-CPU engine; GPU engines with tensor
parallelism) a second round trip through its message queues on every step's critical path.

- worker side (:func:`attach_drafts`, on the model runner that hosts a DuoProposer):
  ``sample_tokens``'s output carries what ``take_draft_token_ids`` would answer right
  after it (nothing runs on the worker between the two);
- engine-core side (:func:`install_drafts_from_output`, from the ``vllm.general_plugins``
  entry point :func:`duo_vllm.vllm.plugin.register`): the executor's
  ``take_draft_token_ids`` answers from the step's output when it carried drafts.

Either side alone changes nothing: an output without drafts (another proposer, no plugin,
a Future under pipeline parallelism) takes vLLM's own call; drafts no one reads are
dropped with the output.
"""

from __future__ import annotations

import functools

from duo_vllm.logs import vllm_logger

logger = vllm_logger(__name__)

CARRIED = "_duo_drafts"  # on a ModelRunnerOutput: (DraftTokenIds | None,)
STASH = "_duo_step_drafts"  # on the executor: the last step's carried drafts
MARK = "_duo_drafts_out"


def attach_drafts(runner) -> bool:
    """Wrap ``runner.sample_tokens`` (this instance only): its output carries the
    step's drafts. False if already wrapped."""
    sample = runner.sample_tokens
    if getattr(sample, MARK, False):
        return False
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    @functools.wraps(sample)
    def sample_tokens(*args, **kwargs):
        out = sample(*args, **kwargs)
        # a fresh output of this step only (vLLM shares one empty output object)
        if type(out) is ModelRunnerOutput and out is not EMPTY_MODEL_RUNNER_OUTPUT:
            setattr(out, CARRIED, (runner.take_draft_token_ids(),))
        return out

    setattr(sample_tokens, MARK, True)
    runner.sample_tokens = sample_tokens
    return True


def with_drafts_from_output(cls) -> bool:
    """Wrap executor class ``cls``: ``take_draft_token_ids`` answers from the last
    ``sample_tokens`` output when it carried drafts. False if already wrapped."""
    if getattr(cls.take_draft_token_ids, MARK, False):
        return False
    execute, sample, take = cls.execute_model, cls.sample_tokens, cls.take_draft_token_ids

    @functools.wraps(execute)
    def execute_model(self, *args, **kwargs):
        self.__dict__.pop(STASH, None)  # a new step: nothing carried yet
        return execute(self, *args, **kwargs)

    @functools.wraps(sample)
    def sample_tokens(self, *args, **kwargs):
        out = sample(self, *args, **kwargs)
        carried = getattr(out, CARRIED, None)  # a Future (non_block) carries nothing
        if carried is None:
            self.__dict__.pop(STASH, None)
        else:
            self.__dict__[STASH] = carried
        return out

    @functools.wraps(take)
    def take_draft_token_ids(self):
        carried = self.__dict__.pop(STASH, None)
        if carried is None:
            return take(self)
        if not self.__dict__.get(MARK):
            self.__dict__[MARK] = True
            logger.info("DuoProposer: the engine core takes each step's drafts from its "
                        "output (no second call to the worker)")
        return carried[0]

    for fn in (execute_model, sample_tokens, take_draft_token_ids):
        setattr(fn, MARK, True)
    cls.execute_model, cls.sample_tokens = execute_model, sample_tokens
    cls.take_draft_token_ids = take_draft_token_ids
    return True


def install_drafts_from_output() -> bool:
    """The engine core's side, on vLLM's multiprocess executor (and its Ray v2
    subclass). The in-process executor's call costs nothing: left alone."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    return with_drafts_from_output(MultiprocExecutor)
