"""End to end: real vLLM (CPU), the real default models, the real Ray draft actor."""

import pytest

from duo_vllm.cli import speculative_config
from duo_vllm.config import nest_tuning
from tests.support.engines import E2E_ENV, run_vllm
from tests.support import step_trace

pytestmark = pytest.mark.e2e

# Serial drafting prefills a new prompt while vLLM waits; the default bound on
# that wait would let vLLM go on without drafts (ten 750-token prompts take the
# one draft core ~10 s, longer than the whole batched run), and the test would
# check nothing. The serial combos wait as long as it takes: each step drafts.
# The bound itself is tested in tests/test_client.py and tests/test_serve.py.
WAIT = {"propose_timeout_s": 120}

BATCHED = "parallel-multi-batched"

# every switch combination that changes behaviour, each against plain vLLM
COMBOS = {
    # drafted while vLLM waits: branch trees (multi-sequence) for ten requests at once
    # (single-sequence chains: parallel-single-auto; the auto budget: the parallel combos
    # and tests/test_goodput.py)
    "serial": ({"parallel": False, "multi_sequence": True, "budget": 4, **WAIT}, False),
    "parallel-single-auto": ({"parallel": True, "multi_sequence": False, "budget": "auto"}, True),
    # lookup drafts may run to 8 tokens, the draft model's to 4 (max_draft_len); no gate:
    # both sources every step (the gate may rightly prefer lookups alone, tests/test_gate.py);
    # four draft slots for the ten prompts, then the first three again: their slots went
    # to others, and the prompt cache gives their draft sequences back
    "parallel-multi-auto": ({"parallel": True, "multi_sequence": True, "budget": "auto",
                             "max_draft_len": 4, "gate": False, "max_sequences": 4}, True),
    # ten requests at once, pre-drafted branch trees served on a hit: the fixed budget and
    # no gate make every step ask the draft (at ten requests the verdict rightly starts
    # on lookups and may never turn the model on; with the auto budget one draft core
    # drafts little for ten: the equality would then check plain decoding)
    BATCHED: ({"multi_sequence": True, "budget": 4, "gate": False}, False),
    # (a fixed budget: "serial" here, and pre-drafted branch trees under sampling,
    # tests/test_distribution.py)
    # the target bound to both cores lends core 1 to the draft while it drafts
    # (duo_vllm/host/lending.py): its thread count switches between steps; then four
    # prompts at once, above max_batch: no draft work for them (THEN_BATCHED)
    "lend": ({"draft_cores": [1], "max_batch": 1}, True),
}
ENV = {"lend": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}}


LOOKUP_K = {"parallel-multi-auto": 8}
THEN_BATCHED = {"lend": 4}  # prompts asked at once after the others, in the same engine
AGAIN = {"parallel-multi-auto": 3}  # prompts asked again after the ten


@pytest.mark.parametrize("combo", list(COMBOS))
def test_greedy_output_equals_plain_vllm(combo, session_tmp, target_dir, specbench_chat,
                                         plain_greedy):
    duo_cfg, sequential = COMBOS[combo]
    again = AGAIN.get(combo, 0)
    duo = run_vllm(session_tmp, f"duo-{combo}", target=target_dir,
                   prompts=specbench_chat + specbench_chat[:again],
                   max_tokens=64, sequential=sequential,
                   env={**E2E_ENV, **ENV.get(combo, {})},
                   then_batched=specbench_chat[:THEN_BATCHED.get(combo, 0)],
                   trace=combo in THEN_BATCHED,
                   speculative_config=speculative_config(LOOKUP_K.get(combo, 4),
                                                         nest_tuning(duo_cfg)))
    assert len(specbench_chat) >= 10
    want_ids = plain_greedy["token_ids"] + plain_greedy["token_ids"][:again]
    assert len(duo["token_ids"]) == len(want_ids)
    for i, (want, got) in enumerate(zip(want_ids, duo["token_ids"])):
        assert got == want, f"{combo}, prompt {i}: DuoProposer output differs from plain vLLM"
    m = duo["metrics"]
    stats = duo["draft_stats"]
    # the equality exercised verification: drafts were proposed, and some accepted
    assert m["proposed"] > 0 and m["accepted"] > 0, m
    if combo == BATCHED:
        # the draft model's own drafts among them, not only lookup copies
        assert stats["returned_tokens"] > 0 and stats["predraft_hits"] > 0, stats
        # ten new prompts handed to the actor before vLLM prefilled them, and prefilled
        # in the background (that no step waits for such a prefill is checked without
        # a clock in tests/test_drafter.py, test_worker_never_makes_vllm_wait_...)
        assert stats["prefetched_prompts"] > 0 and stats["predraft_tokens"] > 0, stats
        return
    if combo in LOOKUP_K:  # rag and summarization answers quote their prompt: free drafts
        assert stats["lookup_tokens_served"] > 0, stats
        assert stats["lookup_tokens_accepted"] > 0, stats
    if again:  # the prompts asked again were restored from the draft's prompt cache
        assert stats["cache_hits"] >= 1 and stats["cache_tokens"] > 0, stats
        assert stats["cache_failures"] == 0, stats
    # the draft ran in the Ray actor, pinned to core 1, next to a target on core 0
    assert "DuoProposer: draft" in duo["log"] and "cores [1]" in duo["log"], duo["log"][-3000:]
    assert stats["returned_tokens"] + stats["lookup_tokens_served"] >= m["proposed"], stats
    # per-request state: context tokens are reused, not re-prefilled every step
    assert stats["reused_tokens"] > 5 * stats["prefill_tokens"], stats
    if combo == "lend":  # started on both cores, gave core 1 to the draft when it drafted
        assert "lends CPU(s) [1]" in duo["log"], duo["log"][-3000:]
        # the real model's oneDNN layers were found, to be remade after a lend, before a
        # lent step that would reuse a shape made on one thread (where this vLLM build
        # runs linear layers through oneDNN): at most once a lend
        from vllm import _custom_ops

        if getattr(_custom_ops, "_supports_onednn", False):
            assert "oneDNN matmuls (5 weight shapes) are remade" in duo["log"], \
                duo["log"][-3000:]
            assert stats["matmul_remakes"] <= (stats["lend_switches"] + 1) // 2, stats
        assert stats["lend_switches"] >= 1, stats
        # every prompt prefilled on both cores, then handed to the draft one-way
        assert stats["lent_prefills"] >= 10 and stats["side_prefills"] == 0, stats
        assert stats["prefetched_prompts"] > 0, stats
        # four requests at once, above max_batch 1: the same tokens as plain vLLM, and
        # no call to the draft actor on a step above the cap
        assert duo["then_token_ids"] == plain_greedy["token_ids"][:4]
        before = duo["draft_stats_before_batched"]
        capped, calls, steps = (stats[k] - before[k] for k in
                                ("capped_steps", "propose_calls", "propose_steps"))
        assert before["capped_steps"] == 0 and capped > 0, stats
        assert calls <= steps - capped, (before, stats)
        # and each step without drafts ran plain vLLM's code, the proposer's call aside:
        # the same step functions, in the same order, as plain vLLM's steps on those
        # prompts (inputs prepared for plain decoding, the plain sampler, no rejection
        # sampler). Some steps may verify drafts: while the first prompt prefills alone,
        # or the last one decodes alone, the batch is 1, under the cap.
        free = step_trace.steps(duo["then_trace"], drafts=False)
        plain = step_trace.steps(plain_greedy["then_trace"])
        assert len(free) >= 32 and set(free) == set(plain), (set(free), set(plain))
        return
    if duo_cfg.get("parallel", True):
        assert stats["predraft_hit_rate"] > 0.3, stats  # drafts served without waiting
        # prompts reach the draft before vLLM prefills them (patches/README.md, 2)
        assert stats["prefetched_prompts"] > 0, stats
    else:
        assert stats["predraft_hit_rate"] == 0 and stats["predraft_tokens"] == 0, stats
        assert stats["prefetched_prompts"] == 0, stats
