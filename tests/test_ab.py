"""benchmarks/ab.py's summary: each arm against plain vLLM of the same round."""

from benchmarks.ab import markdown, summarise


def arm(tokens, seconds, ids):
    return {"tokens": tokens, "seconds": seconds, "token_ids": ids}


def test_ratios_are_paired_per_round_and_greedy_equality_is_checked():
    # round 1 ran twice as fast for every arm (drift): the pairs cancel it
    rounds = [{"plain": arm(100, 10.0, [[1, 2]]), "on": arm(120, 10.0, [[1, 2]]),
               "off": arm(95, 10.0, [[1, 2]])},
              {"plain": arm(100, 5.0, [[3]]), "on": arm(120, 5.0, [[3]]),
               "off": arm(95, 5.0, [[4]])}]
    summary = {s["arm"]: s for s in summarise({"arms": ["plain", "on", "off"],
                                               "rounds": rounds}, greedy=True)}
    assert summary["plain"]["vs_plain"] == 1.0
    assert abs(summary["on"]["vs_plain"] - 1.2) < 1e-9
    assert abs(summary["on"]["lo"] - 1.2) < 1e-9 and abs(summary["on"]["hi"] - 1.2) < 1e-9
    assert summary["on"]["tok_s"] == 18.0  # the median of 12 and 24 tok/s
    assert summary["on"]["greedy_equal"] is True
    assert summary["off"]["greedy_equal"] is False  # round 1 differs from plain
    table = markdown(list(summary.values()), {"cpu": "x", "cores": 2, "batch": 4,
                                              "temperature": 0.0, "max_tokens": 8, "rounds": 2})
    assert "| off | 14.2 | 0.95x | 0.95-0.95x | **no** |" in table
