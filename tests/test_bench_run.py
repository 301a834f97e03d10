"""benchmarks/run.py: which prompts a batch shape runs."""

from benchmarks.run import task_turns


def test_a_batch_mixes_the_tasks():
    tasks = ["translation"] * 4 + ["summarization"] * 4 + ["qa"] * 4 + ["rag"] * 2
    order = task_turns(tasks)
    assert sorted(order) == list(range(len(tasks)))  # every prompt, once
    assert [tasks[i] for i in order[:4]] == ["translation", "summarization", "qa", "rag"]
    assert order[:5] == [0, 4, 8, 12, 1]  # each task's prompts in their own order
    assert order[-3:] == [3, 7, 11]  # rag ran out: the others take turns
    assert task_turns(["qa", "qa"]) == [0, 1] and task_turns([]) == []
