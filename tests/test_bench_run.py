"""benchmarks/run.py: which prompts a batch shape runs, and what a batch row keeps."""

from types import SimpleNamespace as NS

from benchmarks.run import finish_times, task_turns


def test_a_batch_mixes_the_tasks():
    tasks = ["translation"] * 4 + ["summarization"] * 4 + ["qa"] * 4 + ["rag"] * 2
    order = task_turns(tasks)
    assert sorted(order) == list(range(len(tasks)))  # every prompt, once
    assert [tasks[i] for i in order[:4]] == ["translation", "summarization", "qa", "rag"]
    assert order[:5] == [0, 4, 8, 12, 1]  # each task's prompts in their own order
    assert order[-3:] == [3, 7, 11]  # rag ran out: the others take turns
    assert task_turns(["qa", "qa"]) == [0, 1] and task_turns([]) == []


def test_a_batch_row_keeps_each_request_s_latency():
    """A batch's tokens/s is its slowest request's; each request's own wait is kept too,
    from vLLM's per-request timestamps, and nothing where vLLM kept none."""
    outs = [NS(metrics=NS(last_token_ts=t)) for t in (105.0, 107.5, 103.0)]
    assert finish_times(outs, 100.0) == [5.0, 7.5, 3.0]
    assert finish_times(outs + [NS(metrics=None)], 100.0) == []
    assert finish_times([NS(metrics=NS(last_token_ts=0.0))], 100.0) == []
