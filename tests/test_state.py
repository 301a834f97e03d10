import numpy as np

from duo_vllm.draft.slots import SlotPool, common_prefix_len


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
    # the longest match wins slot 0; the shorter one gets the remaining (empty) slot
    assert [x.slot.seq_id for x in got] == [1, 2, 0]
    assert [x.reuse for x in got] == [2, 0, 3]


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


TEMPLATE = (50, 51, 52, 53)  # the chat template every prompt starts with


def test_a_shared_chat_template_is_no_match():
    pool = SlotPool(3)
    pool.note_prompts([a(*TEMPLATE, 1, 2), a(*TEMPLATE, 7, 8, 9)])
    assert pool.template_len == len(TEMPLATE)
    pool.slots[0].tokens = a(*TEMPLATE, 1, 2, 3)  # an earlier request, finished
    pool.slots[0].last_used = 5
    (x,) = pool.assign([a(*TEMPLATE, 9, 9)])
    assert x.slot.seq_id == 1  # an empty slot, not the template match
    # a real shared prefix (a second turn of that conversation) is reused
    (y,) = pool.assign([a(*TEMPLATE, 1, 2, 3, 4, 5)])
    assert y.slot.seq_id == 0 and y.reuse == len(TEMPLATE) + 3


def test_prefetch_never_takes_a_live_slot():
    pool = SlotPool(2)
    pool.slots[0].tokens, pool.slots[1].tokens = a(1, 1), a(2, 2)
    pool.slots[0].last_used, pool.slots[1].last_used = 1, 2
    # slot 0 is the least recently used, but its request is running (live)
    (x,) = pool.assign([a(3, 3)], live={0})
    assert x.slot.seq_id == 1
    assert pool.assign([a(4, 4)], live={0, 1}) == [None]  # no slot: plain decoding


def test_a_queued_slot_is_protected_until_its_request_comes_or_expires():
    pool = SlotPool(1)
    (x,) = pool.assign([a(1, 2, 3)])
    x.slot.queued, x.slot.queued_at = a(1, 2, 3), pool.clock
    assert pool.assign([a(9, 9)]) == [None]  # a stranger does not take it
    pool.clock += pool.QUEUED_TTL + 1
    (y,) = pool.assign([a(9, 9)])  # its request never came
    assert y.slot.seq_id == 0 and y.slot.queued is None


def test_a_window_slot_holds_the_head_and_the_tail_and_matches_there():
    pool = SlotPool(2, window=8)  # the first 2 tokens and the last 6
    long = np.arange(1, 21, dtype=np.int32)  # 1..20
    (x,) = pool.assign([long])
    assert (x.slot.head, x.slot.offset) == (2, 14) and x.reuse == 0
    assert list(x.view) == [1, 2, 15, 16, 17, 18, 19, 20]
    x.slot.tokens = x.view  # evaluated
    # the same request a step later: its view goes on from the same offset
    (y,) = pool.assign([np.append(long, [21, 22])])
    assert y.slot is x.slot and list(y.view) == [1, 2, 15, 16, 17, 18, 19, 20, 21, 22]
    assert y.reuse == 8
    # another request that shares the head only: not this slot's
    other = np.concatenate([long[:4], np.arange(40, 58)]).astype(np.int32)
    (z,) = pool.assign([other])
    assert z.slot is not x.slot and list(z.view) == [1, 2, 52, 53, 54, 55, 56, 57]
    # a context shorter than the window's start never matches the slot by its head
    assert pool._match(x.slot, long[:10]) == 0


def test_short_contexts_are_whole_under_a_window():
    pool = SlotPool(1, window=8)
    (x,) = pool.assign([a(1, 2, 3)])
    assert x.slot.offset == 0 and list(x.view) == [1, 2, 3]


def test_a_long_prompt_sharing_a_preamble_with_a_short_one_gets_a_window():
    # a short request's slot holds all of it (offset 0); a long prompt that shares its
    # first 6 tokens would evaluate 24 more through that slot, against 8 in a new window
    pool = SlotPool(2, window=8)
    short = np.arange(1, 8, dtype=np.int32)  # 7 tokens: whole under the window
    (x,) = pool.assign([short])
    x.slot.tokens = x.view
    long = np.concatenate([short[:6], np.arange(50, 74)]).astype(np.int32)  # 30 tokens
    (y,) = pool.assign([long])
    assert (y.slot.head, y.slot.offset) == (2, 24) and len(y.view) == 8
    assert y.reuse == (2 if y.slot is x.slot else 0)  # the head, where it is that slot
    # a continuation of the short one still matches its slot (2 tokens to evaluate)
    pool = SlotPool(2, window=8)
    (x,) = pool.assign([short])
    x.slot.tokens = x.view
    (z,) = pool.assign([np.append(short, [8, 9])])
    assert z.slot is x.slot and z.reuse == 7 and z.slot.offset == 0
