"""The draft's sequences: the state the drafter owns (slots, branch trees, the prompt
cache, measured costs and acceptance), and the llama.cpp calls on it."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np

from duo_vllm.control.drafting import PRIOR_PREFILL_S, restore_pays
from duo_vllm.control.goodput import Acceptance, DraftTimeModel
from duo_vllm.draft.branching import Branch, Tree
from duo_vllm.draft.prompt_cache import PromptCache
from duo_vllm.draft.sampling import draft_q, sample_q
from duo_vllm.draft.slots import (
    Assignment, Slot, SlotPool, common_prefix_len, pool_window, window_view,
)
from duo_vllm.stats import DraftStats, Ema

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftPolicy:
    """What the drafter does each step (the ablation switches live here)."""

    k: int  # most draft tokens returned per request per step
    parallel: bool = True  # pre-draft while the target verifies
    multi_sequence: bool = True  # several branches where the draft is unsure
    budget: int | None = None  # None: the goodput controller; N: always N tokens per request
    max_branches: int = 4
    # sampled requests' drafts drawn from the draft's q (sampling.py); False: the argmax
    sampled_drafts: bool = False
    vocab_limit: int | None = None  # drawn tokens stay below it (the target's vocabulary)

    @property
    def predrafts(self) -> bool:
        """Does anything run in the background (pre-drafts, prefills)?"""
        return self.parallel and self.budget != 0


class DraftSequences:
    """Slots, branch trees and measured costs over a multi-sequence backend, and its calls."""

    def __init__(self, backend, max_sequences: int, n_ctx: int, policy: DraftPolicy,
                 window: int | None = None, seed: int | None = None, cache_bytes: int = 0):
        self.backend, self.n_ctx, self.policy = backend, n_ctx, policy
        # the KV of requests whose slot went to another, for when they come back
        self.cache = PromptCache(cache_bytes) if cache_bytes > 0 else None
        self.rng = np.random.default_rng(seed)  # the draws of sampled drafts
        self.last_q: list = []  # each row's q of its last draft (None: not drawn)
        self.pool = SlotPool(max_sequences, window=pool_window(window, n_ctx))
        self.n_extra = max(policy.max_branches - 1, 0)
        self.trees: dict[int, Tree] = {}
        self.last_draft: dict[int, tuple[int, list[int], str]] = {}
        self.jobs: list = []  # the next step's pre-draft (predraft._Job each)
        self.planned: set[int] = set()  # slots whose pre-draft was planned at the last step
        self.stats = DraftStats()
        self.token_s = Ema()  # draft time per evaluated token (decode widths <= 16)
        self.prefill_s = Ema()  # draft time per token of long prefills
        self.draft_time = DraftTimeModel()  # D(w), by decode width
        self.acceptance = Acceptance()  # α per request (slot) and regime
        self.target_step_s = None  # T₀(B) of the last step (from the proposer)
        self.per_token_s = None  # c, the target's cost per extra verified token
        self.expected_step_s = None  # the target step under way, as planned
        self.busy_until = 0.0  # when the decode call under way should end (perf_counter)
        self.live: set[int] = set()  # slots of the requests of the last step
        self.quiet: dict[int, int] = {}  # slot -> steps since its last draft (probe clock)
        self.floor_streak = 0  # steps in a row that drafted nothing (floor_streak_after)

    # -- backend calls, timed --------------------------------------------------
    def _decode(self, items):
        """One backend decode call, timed (for D(w)); returns (logits, tokens evaluated)."""
        t0 = time.perf_counter()
        n = sum(len(toks) for _, toks, _ in items)
        self.busy_until = t0 + self.draft_time(n)  # read by the actor, without the lock
        try:
            out = self.backend.decode(items)
        finally:
            self.busy_until = 0.0
        dt = time.perf_counter() - t0
        (self.token_s if n <= 16 else self.prefill_s).add(dt / max(n, 1))
        self.draft_time.observe(n, dt)
        return out, n

    def calibrate(self, widths=(1, 2, 3, 4), warm_tokens: int = 8) -> dict[int, float]:
        """Measure D(w) for the narrow widths a pre-draft uses, on slot 0 before the first
        request (else D(1) may be read off prefill chunks: too slow for any pre-draft)."""
        sid = self.pool.slots[0].seq_id
        toks = np.arange(1, warm_tokens + 1, dtype=np.int32)  # any tokens: timing only
        try:
            self.backend.decode([(sid, toks, 0)])
            pos = warm_tokens
            for w in widths:
                self._decode([(sid, toks[:w], pos)])
                pos += w
        finally:
            self.backend.remove(sid, 0, -1)
        return self.draft_time.table()

    def _branch_seq(self, slot_id: int, j: int) -> int:
        return self.pool.size + slot_id * self.n_extra + (j - 1)

    def _clear_tree(self, slot_id: int) -> None:
        tree = self.trees.pop(slot_id, None)
        if tree is not None:
            for br in tree.branches:
                if br.seq_id != slot_id:
                    self.backend.remove(br.seq_id, 0, -1)

    def _next_token(self, logits: np.ndarray, temperature: float):
        """The next draft token and its q: drawn from q, else the argmax (q None)."""
        if self.policy.sampled_drafts and temperature >= 1e-5:
            q = draft_q(logits, temperature, limit=self.policy.vocab_limit)
            return sample_q(*q, self.rng), q
        return int(np.argmax(logits)), None

    def _extend(self, branch: Branch, logits: np.ndarray, temperature: float) -> None:
        """Grow ``branch`` by the draft token after its last, and keep its q."""
        tok, q = self._next_token(logits, temperature)
        branch.tokens.append(tok)
        branch.q.append(q)

    def _sync_slot(self, slot, ctx: np.ndarray) -> int:
        """Make the slot's main sequence hold ``ctx[:keep]``; return keep (< len(ctx))."""
        keep = min(common_prefix_len(slot.tokens, ctx), len(ctx) - 1)
        self.backend.remove(slot.seq_id, keep, -1)
        slot.tokens = slot.tokens[:keep]
        self.stats.reused_tokens += keep
        return keep

    def _recover(self, slots) -> None:
        """After a failed decode call: log it and empty the slots' sequences."""
        logger.exception("drafting failed; the affected requests get no draft this step")
        self.stats.errors += 1
        for slot in slots:
            self.trees.pop(slot.seq_id, None)
            self.backend.remove(slot.seq_id, 0, -1)
            # every branch sequence of the slot, in the tree or not yet
            for j in range(1, self.n_extra + 1):
                self.backend.remove(self._branch_seq(slot.seq_id, j), 0, -1)
            slot.tokens = np.zeros(0, dtype=np.int32)

    # -- measured costs --------------------------------------------------------
    def _prefill_token_s(self) -> float:
        return self.prefill_s.get(PRIOR_PREFILL_S)

    def _observe_acceptance(self, slot, ctx: np.ndarray, reuse: int, reg: str) -> None:
        """Score the slot's last draft against the context the target produced."""
        prev = self.last_draft.pop(slot.seq_id, None)
        if prev is None:
            return
        n0, draft, prev_reg = prev
        if reuse < min(n0, len(slot.tokens)) or len(ctx) <= n0:
            self.acceptance.forget(slot.seq_id)  # a new request on this slot
            return
        if draft:
            accepted = common_prefix_len(ctx[n0:n0 + len(draft)],
                                         np.asarray(draft, dtype=np.int32))
            self.acceptance.observe(slot.seq_id, prev_reg, accepted, len(draft))

    # -- slots and the prompt cache --------------------------------------------
    def _assign(self, contexts, live=frozenset()) -> list[Assignment | None]:
        """``pool.assign``, with the prompt cache: a slot taken afresh saves what it held,
        then restores the cached sequence its context shares most with, where that pays."""
        out = self.pool.assign(contexts, live)
        if self.cache is None:
            return out
        for i, (ctx, a) in enumerate(zip(contexts, out)):
            if a is None or a.before is None:
                continue
            if len(a.slot.tokens) > self.pool.template_len:
                self._keep(a.slot, *a.before)
            out[i] = self._restore(a, ctx)
        return out

    def _keep(self, slot: Slot, head: int, offset: int) -> None:
        """Save what ``slot`` holds (in window ``head``, ``offset``) to the cache."""
        try:
            state = self.backend.save(slot.seq_id)
        except Exception:  # a speed-up only: the request is prefilled if it comes back
            logger.exception("could not save a draft sequence to the prompt cache")
            return
        if state:
            self.cache.put(slot.tokens, head, offset, state)

    def _restore(self, a: Assignment, ctx: np.ndarray) -> Assignment:
        """``a`` with its slot holding the cached sequence sharing the most with ``ctx``,
        where one spares a prefill (:func:`restore_pays`); else ``a`` as it is."""
        entry, match = self.cache.best(ctx)
        if entry is None or not restore_pays(
                match, a.reuse, len(window_view(ctx, entry.head, entry.offset)),
                self.pool.fresh_tokens(len(ctx))):
            return a
        slot, st = a.slot, self.stats
        self._clear_tree(slot.seq_id)
        self.last_draft.pop(slot.seq_id, None)  # the request it held: nothing to score
        self.backend.remove(slot.seq_id, 0, -1)
        try:
            ok = self.backend.restore(slot.seq_id, entry.state)
        except Exception:
            logger.exception("could not restore a draft sequence from the prompt cache")
            ok = False
        if not ok:  # no room for its cells, say: the slot starts empty
            self.backend.remove(slot.seq_id, 0, -1)
            slot.tokens = slot.tokens[:0]
            st.cache_failures += 1
            return dataclasses.replace(a, reuse=0)
        slot.tokens, slot.head, slot.offset = entry.tokens, entry.head, entry.offset
        view = slot.view(ctx)
        reuse = common_prefix_len(slot.tokens, view)
        st.cache_hits += 1
        st.cache_tokens += min(reuse, len(view) - 1) - a.reuse  # (the last is evaluated anew)
        return dataclasses.replace(a, reuse=reuse, view=view)

    def _slide(self, slot: Slot, ctx: np.ndarray) -> Assignment:
        """Move a slot's window to the last ``window`` tokens of ``ctx`` (evaluated anew)."""
        self._clear_tree(slot.seq_id)
        self.backend.remove(slot.seq_id, 0, -1)
        slot.tokens = np.zeros(0, dtype=np.int32)
        slot.queued = slot.seen = None
        self.last_draft.pop(slot.seq_id, None)
        self.pool.place(slot, len(ctx))
        return Assignment(slot, 0, slot.view(ctx))
