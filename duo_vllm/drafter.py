"""The drafter: chains on demand, branch trees ahead of time, state matched by prefix.

``propose`` answers one vLLM step. For each request it either serves a branch
pre-drafted during the previous step (a *hit*: no draft compute on the
critical path) or drafts a chain from the real context while vLLM waits
(a *miss*). It then queues *pre-draft* jobs: assume the draft just returned
will be fully accepted, and prepare, for the token the target samples after
it, one branch per likely candidate (DuoDecoding's dynamic multi-sequence
drafting). ``predraft`` runs those jobs while vLLM verifies, and stops early
when ``interrupt()`` says the next step has arrived.

Only the greedy top-1 path of each branch is drafted; vLLM's rejection
sampler verifies everything, so drafts change speed, never output.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from .branching import (
    Branch, Tree, branch_candidates, predraft_budget, select_branch, split_budget,
    sync_draft_len, top_candidates,
)
from .state import SlotPool, common_prefix_len

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftPolicy:
    """What the drafter does each step (the ablation switches live here)."""

    k: int  # most draft tokens returned per request per step
    parallel: bool = True  # pre-draft while the target verifies
    multi_sequence: bool = True  # several branches where the draft is unsure
    budget: int | None = None  # None: hardware-aware; N: always N tokens per request
    max_branches: int = 4

    @property
    def predrafts(self) -> bool:
        """Does anything run in the background (pre-drafts, prefills)?"""
        return self.parallel and self.budget != 0


class Ema:
    """Exponential moving average; ``None`` until the first sample."""

    def __init__(self, weight: float = 0.2):
        self.weight, self.value = weight, None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.weight * (x - self.value)

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


@dataclass
class DraftStats:
    """Counters of the draft side, cumulative since start."""

    steps: int = 0
    requests: int = 0  # request-steps served
    predraft_hits: int = 0  # served from a branch, no waiting
    predraft_lookups: int = 0  # request-steps that had a branch tree to look in
    branch_hits: collections.Counter = field(default_factory=collections.Counter)  # by rank
    branch_counts: collections.Counter = field(default_factory=collections.Counter)
    returned_tokens: int = 0
    sync_tokens: int = 0  # evaluated while vLLM waited
    predraft_tokens: int = 0  # evaluated while vLLM verified
    prefill_tokens: int = 0
    reused_tokens: int = 0
    interrupted: int = 0
    skipped_busy: int = 0  # steps that went without a draft: the drafter was prefilling
    prefetched_prompts: int = 0  # prompts evaluated while the target prefilled them
    errors: int = 0
    busy_s: float = 0.0
    started: float | None = None  # the first step

    def as_dict(self) -> dict:
        lookups = self.predraft_lookups
        wall = time.monotonic() - self.started if self.started is not None else 0.0
        return {
            "steps": self.steps,
            "requests": self.requests,
            "predraft_hits": self.predraft_hits,
            "predraft_lookups": lookups,
            "predraft_hit_rate": self.predraft_hits / self.requests if self.requests else 0.0,
            "branch_hit_rate": self.predraft_hits / lookups if lookups else 0.0,
            "branch_hits_by_rank": dict(sorted(self.branch_hits.items())),
            "branch_count_distribution": dict(sorted(self.branch_counts.items())),
            "draft_tokens_per_step": self.returned_tokens / self.steps if self.steps else 0.0,
            "returned_tokens": self.returned_tokens,
            "sync_tokens": self.sync_tokens,
            "predraft_tokens": self.predraft_tokens,
            "prefill_tokens": self.prefill_tokens,
            "reused_tokens": self.reused_tokens,
            "interrupted": self.interrupted,
            "skipped_busy": self.skipped_busy,
            "prefetched_prompts": self.prefetched_prompts,
            "errors": self.errors,
            "busy_fraction": self.busy_s / wall if wall > 0 else 0.0,
        }


@dataclass
class _Job:
    slot_id: int
    prefix: np.ndarray  # context + the draft just returned
    evals: int  # tokens the pre-draft may evaluate for this request, beyond catch-up


class DuoDrafter:
    """Drafts for batches of contexts on a multi-sequence backend (see backends/)."""

    PREFILL_CHUNK = 64  # tokens per decode call when prefilling in the background
    CATCH_UP = 16  # a pre-draft job further behind than this holds a new prompt

    def __init__(self, backend, max_sequences: int, n_ctx: int, policy: DraftPolicy):
        self.backend, self.n_ctx, self.policy = backend, n_ctx, policy
        self.pool = SlotPool(max_sequences)
        self.n_extra = max(policy.max_branches - 1, 0)
        self.trees: dict[int, Tree] = {}
        self.last_draft: dict[int, tuple[int, list[int]]] = {}
        self.jobs: list[_Job] = []
        self.stats = DraftStats()
        self.token_s = Ema()  # draft time per evaluated token (decode widths <= 16)
        self.prefill_s = Ema()  # draft time per token of long prefills
        self.alpha = Ema(0.1)  # fraction of draft tokens the target accepted
        self.target_step_s = None
        self.busy_until = 0.0  # when the decode call under way should end (perf_counter)

    # -- backend calls, timed --------------------------------------------------
    def _decode(self, items):
        t0 = time.perf_counter()
        n = sum(len(toks) for _, toks, _ in items)
        per_token = self.token_s.get(0.015) if n <= 16 else self.prefill_s.get(0.006)
        self.busy_until = t0 + n * per_token  # read by the actor, without the lock
        try:
            out = self.backend.decode(items)
        finally:
            self.busy_until = 0.0
        dt = time.perf_counter() - t0
        (self.token_s if n <= 16 else self.prefill_s).add(dt / max(n, 1))
        return out, n

    def _branch_seq(self, slot_id: int, j: int) -> int:
        return self.pool.size + slot_id * self.n_extra + (j - 1)

    def _clear_tree(self, slot_id: int) -> None:
        tree = self.trees.pop(slot_id, None)
        if tree is not None:
            for br in tree.branches:
                if br.seq_id != slot_id:
                    self.backend.remove(br.seq_id, 0, -1)

    def _sync_slot(self, slot, ctx: np.ndarray) -> int:
        """Make the slot's main sequence hold ``ctx[:keep]``; return keep (< len(ctx))."""
        keep = min(common_prefix_len(slot.tokens, ctx), len(ctx) - 1)
        self.backend.remove(slot.seq_id, keep, -1)
        slot.tokens = slot.tokens[:keep]
        self.stats.reused_tokens += keep
        return keep

    # -- one vLLM step ---------------------------------------------------------
    def propose(self, contexts: list[np.ndarray], max_tokens: list[int],
                target_step_s: float | None = None, serve: bool = True) -> list[list[int]]:
        """Drafts for one step; queues the pre-draft of the next when ``parallel``.

        With ``serve=False`` nothing is drafted now (vLLM has already gone on
        without a draft): only the pre-draft for these contexts is queued.
        """
        t0 = time.perf_counter()
        st, policy = self.stats, self.policy
        st.steps += 1
        if st.started is None:
            st.started = time.monotonic()
        if target_step_s:
            self.target_step_s = target_step_s
        contexts = [np.asarray(c, dtype=np.int32) for c in contexts]
        out: list[list[int]] = [[] for _ in contexts]
        misses: list[tuple[int, object, int]] = []  # (row, slot, k)
        served: list[tuple[int, object]] = []
        assigned = self.pool.assign(contexts)
        for row, (ctx, k, a) in enumerate(zip(contexts, max_tokens, assigned)):
            k = min(int(k), policy.k, self.n_ctx - len(ctx) - 1)
            if a is None or k <= 0 or len(ctx) == 0:
                continue
            st.requests += 1
            slot = a.slot
            served.append((row, slot))
            self._observe_acceptance(slot.seq_id, ctx)
            tree = self.trees.get(slot.seq_id)
            if tree is not None:
                st.predraft_lookups += 1
            branch = select_branch(tree, ctx) if serve else None
            if branch is not None:
                out[row] = self._take_branch(slot, ctx, tree, branch, k)
                st.predraft_hits += 1
                st.branch_hits[tree.branches.index(branch)] += 1
            else:
                self._clear_tree(slot.seq_id)
                if serve and not self._prefill_in_background(len(ctx) - a.reuse,
                                                             len(contexts)):
                    misses.append((row, slot, k))
                elif len(ctx) - a.reuse > self.CATCH_UP:
                    slot.queued = ctx  # a prompt for the background: the slot's name till then
        if misses:
            self._draft_chains(contexts, misses, out)
        self.jobs = []
        for row, slot in served:
            ctx, draft = contexts[row], out[row]
            self.last_draft[slot.seq_id] = (len(ctx), draft)
            st.returned_tokens += len(draft)
            if policy.predrafts and len(ctx) + len(draft) + 2 < self.n_ctx:
                self.jobs.append(_Job(slot.seq_id, np.concatenate(
                    [ctx, np.asarray(draft, dtype=np.int32)]), 0))
        self._plan_jobs()
        st.busy_s += time.perf_counter() - t0
        return out

    def prefetch(self, contexts: list[np.ndarray]) -> int:
        """Prompts the target is about to prefill: queue their evaluation.

        Called before vLLM's prefill step, so the draft evaluates the prompt
        while the target does (DuoDecoding's parallel prefill) and has branches
        for the first output token ready when that step's propose() comes.
        Returns how many prompts were queued (none in serial mode).
        """
        if not self.policy.predrafts:
            return 0
        if self.stats.started is None:  # busy time counts from here, as from a step
            self.stats.started = time.monotonic()
        contexts = [np.asarray(c, dtype=np.int32) for c in contexts]
        queued = 0
        for ctx, a in zip(contexts, self.pool.assign(contexts)):
            if a is None or len(ctx) == 0 or len(ctx) + 2 >= self.n_ctx:
                continue
            self._clear_tree(a.slot.seq_id)
            a.slot.queued = ctx
            self.last_draft.pop(a.slot.seq_id, None)
            self.jobs = [j for j in self.jobs if j.slot_id != a.slot.seq_id]
            self.jobs.append(_Job(a.slot.seq_id, ctx, 0))
            queued += 1
        self.stats.prefetched_prompts += queued
        self._plan_jobs()
        return queued

    def _prefill_in_background(self, new_tokens: int, rows: int = 1) -> bool:
        """Too many new tokens to evaluate while vLLM waits (a new prompt, say)?

        Then this step goes without a draft and the pre-draft evaluates them
        while vLLM decodes: a long prompt never stalls the target.
        """
        if not self.policy.predrafts:
            return False
        step = self.target_step_s or 0.05
        # what fits in one target step, shared by the requests of this step
        fits = int(step / self.prefill_s.get(0.006) / max(rows, 1))
        return new_tokens > max(self.policy.k + 1, fits)

    def _observe_acceptance(self, slot_id: int, ctx: np.ndarray) -> None:
        prev = self.last_draft.get(slot_id)
        if prev is None or not prev[1] or len(ctx) <= prev[0]:
            return
        n0, draft = prev
        accepted = common_prefix_len(ctx[n0:n0 + len(draft)], np.asarray(draft, dtype=np.int32))
        self.alpha.add(accepted / len(draft))

    def _take_branch(self, slot, ctx, tree: Tree, branch: Branch, k: int) -> list[int]:
        """Adopt a pre-drafted branch as the request's sequence; return its draft."""
        pos_b = len(tree.prefix)
        if branch.seq_id != slot.seq_id:
            self.backend.remove(slot.seq_id, pos_b, -1)
            self.backend.copy(branch.seq_id, slot.seq_id, pos_b, -1)
        evaluated = branch.tokens[:-1] if len(branch.tokens) > 1 else []
        slot.tokens = np.concatenate([tree.prefix, np.asarray(evaluated, dtype=np.int32)])
        self._clear_tree(slot.seq_id)
        return list(branch.tokens[1:1 + k])

    def _sync_len(self, k: int, rows: int) -> int:
        """Chain length while vLLM waits; each depth costs a token for each of ``rows``."""
        policy = self.policy
        if policy.budget is not None:
            return min(policy.budget, k)
        if not policy.parallel:
            return k
        step = self.target_step_s or 0.05
        return min(k, sync_draft_len(self.alpha.get(0.7), rows * self.token_s.get(0.015),
                                     step, verify_token_s=0.1 * step, k=k))

    def _draft_chains(self, contexts, misses, out) -> None:
        """Greedy chains from the real contexts, all requests decoded together."""
        live = []
        items = []
        for row, slot, k in misses:
            n = self._sync_len(k, len(misses))
            if n <= 0:
                continue
            ctx = contexts[row]
            keep = self._sync_slot(slot, ctx)
            items.append((slot.seq_id, ctx[keep:], keep))
            self.stats.prefill_tokens += len(ctx) - keep
            slot.tokens = ctx
            live.append([row, slot, n])
        if not items:
            return
        try:
            logits, _ = self._decode(items)
            while live:
                nxt_items, still = [], []
                for (row, slot, n), lg in zip(live, logits):
                    out[row].append(int(np.argmax(lg)))
                    if len(out[row]) < n:
                        tok = out[row][-1]
                        nxt_items.append((slot.seq_id, np.array([tok], dtype=np.int32),
                                          len(slot.tokens)))
                        slot.tokens = np.append(slot.tokens, np.int32(tok))
                        still.append([row, slot, n])
                if not nxt_items:
                    break
                logits, n_tok = self._decode(nxt_items)
                self.stats.sync_tokens += n_tok
                live = still
        except Exception:
            self._recover([slot for _, slot, _ in misses])
            for row, _, _ in misses:
                out[row] = []

    def _recover(self, slots) -> None:
        logger.exception("drafting failed; the affected requests get no draft this step")
        self.stats.errors += 1
        for slot in slots:
            self._clear_tree(slot.seq_id)
            self.backend.remove(slot.seq_id, 0, -1)
            slot.tokens = np.zeros(0, dtype=np.int32)

    def _plan_jobs(self) -> None:
        """Give each pre-draft job its evaluation budget (hardware-aware unless fixed)."""
        if not self.jobs:
            return
        policy = self.policy
        if policy.budget is not None:
            per_row = policy.budget
        else:
            per_row = predraft_budget(self.target_step_s or 0.05, self.token_s.get(0.015),
                                      catch_up=1, k=policy.k, rows=len(self.jobs))
        for job in self.jobs:
            job.evals = per_row

    # -- ahead of time, while vLLM verifies ------------------------------------
    def deadline_after(self, returned_at: float) -> float | None:
        """When the pre-draft should be done: when vLLM is expected back (auto budget)."""
        if self.policy.budget is not None or not self.target_step_s:
            return None
        return returned_at + self.target_step_s

    def predraft(self, interrupt=lambda: False, deadline: float | None = None) -> None:
        """Run the queued pre-draft jobs.

        Stops between decode calls on ``interrupt()`` (the next step is here).
        Branches also stop growing when another decode would end more than
        half a token past ``deadline`` (``time.perf_counter()`` clock); prompt
        prefills go on past it. The catch-up and the top-1 candidate are
        always evaluated: without them no branch can hit.
        """
        jobs, self.jobs = self.jobs, []
        if not jobs:
            return
        t0 = time.perf_counter()
        half = 0.5 * self.token_s.get(0.015)

        def stop():
            return interrupt() or (deadline is not None
                                   and time.perf_counter() + half > deadline)
        try:
            self._predraft(jobs, interrupt, stop)
        except Exception:
            self._recover([self.pool.slots[j.slot_id] for j in jobs])
        self.stats.busy_s += time.perf_counter() - t0

    def _predraft(self, jobs: list[_Job], interrupt, stop) -> None:
        """Grow branch trees for the jobs that are caught up; prefill the others.

        A job with more than ``CATCH_UP`` tokens to evaluate holds a new prompt.
        Those are prefilled in shared chunks of ``PREFILL_CHUNK`` tokens, the
        shortest first, and each joins the tree growing once it is caught up.
        So a request already decoding never waits behind another's prompt, and
        no decode call outlasts one chunk.
        """
        slots = {job.slot_id: self.pool.slots[job.slot_id] for job in jobs}
        for job in jobs:
            self._sync_slot(slots[job.slot_id], job.prefix)
        while jobs:
            behind = [len(job.prefix) - len(slots[job.slot_id].tokens) for job in jobs]
            ready = [job for job, n in zip(jobs, behind) if n <= self.CATCH_UP]
            jobs = [job for job, n in zip(jobs, behind) if n > self.CATCH_UP]
            if ready:
                self._grow_trees(ready, [slots[job.slot_id] for job in ready], interrupt, stop)
            if not jobs:
                return
            if interrupt():
                self.stats.interrupted += 1  # the prefill goes on next time, from where it is
                return
            self._prefill_chunk(jobs, slots)

    def _prefill_chunk(self, jobs: list[_Job], slots: dict) -> None:
        """One decode call of up to ``PREFILL_CHUNK`` prompt tokens, shortest prompt first.

        Each prompt's last token is left for the tree growing (its logits are
        the first branch point).
        """
        items, owners, room = [], [], self.PREFILL_CHUNK
        for job in sorted(jobs, key=lambda j: len(j.prefix) - len(slots[j.slot_id].tokens)):
            slot = slots[job.slot_id]
            start = len(slot.tokens)
            n = min(len(job.prefix) - start - 1, room)
            items.append((slot.seq_id, job.prefix[start:start + n], start))
            owners.append((job, slot, start + n))
            room -= n
            if room <= 0:
                break
        _, n = self._decode(items)
        self.stats.predraft_tokens += n
        for job, slot, end in owners:
            slot.tokens = job.prefix[:end]

    def _grow_trees(self, jobs: list[_Job], slots: list, interrupt, stop) -> None:
        st, policy = self.stats, self.policy
        # 1. catch up: evaluate the tail of the returned draft (usually its last
        #    token; at most CATCH_UP tokens a job, so one decode call)
        items = [(slot.seq_id, job.prefix[len(slot.tokens):], len(slot.tokens))
                 for job, slot in zip(jobs, slots)]
        logits, n = self._decode(items)
        st.predraft_tokens += n
        tops = [top_candidates(lg) for lg in logits]
        for job, slot in zip(jobs, slots):
            slot.tokens = job.prefix
        trees = [Tree(job.prefix, [Branch([int(ids[0])], float(p[0]), slot.seq_id)])
                 for job, slot, (ids, p) in zip(jobs, slots, tops)]
        for slot, tree in zip(slots, trees):
            self.trees[slot.seq_id] = tree
        if interrupt():
            st.interrupted += 1
            return
        # 2. evaluate the top-1 candidate: its successor, and p2 for the θ rule
        items = [(slot.seq_id, np.array(tree.branches[0].tokens, dtype=np.int32),
                  len(tree.prefix)) for slot, tree in zip(slots, trees)]
        logits, n = self._decode(items)
        st.predraft_tokens += n
        evals_left = []
        for job, slot, tree, (ids, probs), lg in zip(jobs, slots, trees, tops, logits):
            main = tree.branches[0]
            slot.tokens = np.append(slot.tokens, np.int32(main.tokens[0]))
            if policy.multi_sequence and self.n_extra:
                p2_ids, p2_probs = top_candidates(lg, 1)
                first = branch_candidates(ids, probs, float(p2_probs[0]), policy.max_branches)
                main.tokens.append(int(p2_ids[0]))
            else:
                first = [main.tokens[0]]
                main.tokens.append(int(np.argmax(lg)))
            weights = [float(probs[list(ids).index(t)]) for t in first]
            alloc = split_budget(job.evals, weights, cap=policy.k, alpha=self.alpha.get(0.8))
            alloc[0] = max(alloc[0], 1)  # the top-1 candidate is already evaluated once
            left = [alloc[0] - 1]
            for j, (tok, w, a) in enumerate(zip(first[1:], weights[1:], alloc[1:]), start=1):
                if a <= 0:
                    continue
                seq = self._branch_seq(slot.seq_id, j)
                self.backend.remove(seq, 0, -1)
                self.backend.copy(slot.seq_id, seq, 0, len(tree.prefix))
                tree.branches.append(Branch([tok], w, seq))
                left.append(a)
            st.branch_counts[len(tree.branches)] += 1
            evals_left.append(left)
        # 3. extend every branch greedily, all branches of all requests in one decode
        while not stop():
            items, owners = [], []
            for slot, tree, left in zip(slots, trees, evals_left):
                for j, br in enumerate(tree.branches):
                    if left[j] <= 0:
                        continue
                    pos = len(tree.prefix) + len(br.tokens) - 1
                    if pos + 2 >= self.n_ctx:
                        left[j] = 0
                        continue
                    items.append((br.seq_id, np.array(br.tokens[-1:], dtype=np.int32), pos))
                    owners.append((br, left, j, slot))
            if not items:
                return
            logits, n = self._decode(items)
            st.predraft_tokens += n
            for (br, left, j, slot), lg in zip(owners, logits):
                if br.seq_id == slot.seq_id:
                    slot.tokens = np.append(slot.tokens, np.int32(br.tokens[-1]))
                br.tokens.append(int(np.argmax(lg)))
                left[j] -= 1
        st.interrupted += 1
