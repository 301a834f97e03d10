import numpy as np

from duo_vllm.state import SlotPool, common_prefix_len


def a(*xs):
    return np.array(xs, dtype=np.int32)


def test_common_prefix_len():
    assert common_prefix_len(a(1, 2, 3), a(1, 2, 4)) == 2
    assert common_prefix_len(a(1, 2), a(1, 2, 3)) == 2
    assert common_prefix_len(a(), a(1)) == 0
    assert common_prefix_len(a(5), a(6)) == 0
    assert common_prefix_len(a(1, 2, 3), a(1, 2, 3)) == 3


def test_pool_matches_by_longest_prefix_and_never_shares_a_slot():
    pool = SlotPool(3)
    pool.slots[0].tokens = a(1, 2, 3)
    pool.slots[1].tokens = a(7, 8)
    got = pool.assign([a(7, 8, 9), a(1, 2, 5), a(1, 2, 3, 4)])
    assert [x.slot.seq_id for x in got[:2]] == [1, 0]
    assert [x.reuse for x in got[:2]] == [2, 2]
    # slot 0 is taken, so the third context gets the remaining (empty) slot
    assert got[2].slot.seq_id == 2 and got[2].reuse == 0


def test_pool_recycles_least_recently_used_and_is_bounded():
    pool = SlotPool(2)
    pool.assign([a(1, 1)])
    pool.slots[0].tokens = a(1, 1)
    pool.assign([a(2, 2)])
    pool.slots[1].tokens = a(2, 2)
    pool.assign([a(1, 1, 5)])  # touches slot 0 again
    (x,) = pool.assign([a(3, 3)])  # no prefix anywhere: recycle the LRU slot 1
    assert x.slot.seq_id == 1 and x.reuse == 0
    assert len(pool.slots) == 2
    assert pool.assign([a(1), a(2), a(3)])[2] is None  # more contexts than slots


def test_a_queued_prompt_finds_its_slot_before_any_of_it_is_evaluated():
    pool = SlotPool(3)
    x, y = pool.assign([a(1, 2, 3), a(4, 5, 6)])
    x.slot.queued, y.slot.queued = a(1, 2, 3), a(4, 5, 6)  # prefetched, nothing evaluated
    got = pool.assign([a(9, 9), a(4, 5, 6, 7), a(1, 2, 3, 8)])  # the first step, + a stranger
    assert got[1].slot is y.slot and got[2].slot is x.slot
    assert got[1].reuse == got[2].reuse == 0  # what the slot holds, not what it waits for
    assert got[0].slot.seq_id == 2 and got[0].slot.queued is None


def test_a_new_context_never_takes_the_slot_of_a_later_row():
    pool = SlotPool(2)
    pool.slots[0].tokens, pool.slots[1].tokens = a(1, 1), a(2, 2)
    pool.slots[1].last_used = -1  # slot 1 is the least recently used
    got = pool.assign([a(3, 3), a(2, 2, 5)])  # the stranger comes first in the batch
    assert got[1].slot.seq_id == 1 and got[1].reuse == 2  # the known request keeps its slot
    assert got[0].slot.seq_id == 0 and got[0].reuse == 0
