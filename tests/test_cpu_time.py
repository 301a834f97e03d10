"""benchmarks.cpu_time: CPU seconds per thread from two /proc snapshots."""

import os

from benchmarks.cpu_time import cpu_seconds, snapshot


def test_cpu_seconds_lists_the_threads_that_ran_most_first_and_skips_idle_ones():
    tick = os.sysconf("SC_CLK_TCK")
    before = {(1, 1): ("a", "a", 10, 0), (2, 2): ("b", "w", 5, 1), (3, 3): ("c", "c", 7, 0)}
    after = {(1, 1): ("a", "a", 10 + tick, 0), (2, 2): ("b", "w", 5 + 3 * tick, 1),
             (3, 3): ("c", "c", 7, 0), (4, 4): ("d", "d", tick // 2, 1)}  # (4, 4) is new
    rows = cpu_seconds(before, after)
    assert [r[1] for r in rows] == [2, 1, 4]  # the idle thread (3, 3) is left out
    assert rows[0] == [3.0, 2, "b", "w", 1]


def test_snapshot_sees_this_process():
    assert any(pid == os.getpid() for pid, _ in snapshot())
