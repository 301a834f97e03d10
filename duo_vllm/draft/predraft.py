"""The pre-draft: the next step's branch trees, grown while vLLM verifies this one.

Per request the controller plans it for, from the root the next step most likely
starts at: one branch per likely candidate for the target's next token
(DuoDecoding's dynamic multi-sequence drafting). Runs on the background thread,
with the prompts :meth:`Predrafter.prefetch` queued, till the next step or its deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from duo_vllm.control.drafting import (
    PRIOR_STEP_S, call_overruns, ends_at_root, needs_prefill, predraft_catch_up,
    predraft_deadline, prefill_chunk, prefills_prompts, probe_affordable, probe_due,
    prompt_depth,
)
from duo_vllm.control.goodput import TargetCost, catch_up_pays, plan_predraft, regime
from duo_vllm.draft.branching import Branch, Tree, branch_candidates, split_budget, top_candidates
from duo_vllm.draft.sequences import DraftSequences
from duo_vllm.draft.slots import common_prefix_len

if TYPE_CHECKING:
    from duo_vllm.draft.drafter import _Row


@dataclass
class _Job:
    slot_id: int
    prefix: np.ndarray  # context + the draft just returned
    evals: int  # draft tokens the pre-draft grows for this request (its planned depth)
    temperature: float = 0.0


class Predrafter(DraftSequences):
    """Plans and runs the pre-draft of the next step, and prefills new prompts."""

    def prefetch(self, contexts: list[np.ndarray]) -> int:
        """Queue the prompts the target is about to prefill, for the draft to prefill
        alongside (DuoDecoding's parallel prefill); returns how many were queued."""
        if not self.policy.predrafts or not prefills_prompts(self.floor_streak):
            return 0
        if self.stats.started is None:  # busy time counts from here, as from a step
            self.stats.started = time.monotonic()
        contexts = [np.asarray(c, dtype=np.int32) for c in contexts]
        self.pool.note_prompts(contexts)
        queued = 0
        for ctx, a in zip(contexts, self._assign(contexts, live=self.live)):
            if a is None:
                self.stats.no_slot += 1
                continue
            ctx = a.view
            if len(ctx) == 0 or len(ctx) + 2 >= self.n_ctx:
                continue
            sid = a.slot.seq_id
            self._clear_tree(sid)
            a.slot.queued, a.slot.queued_at = ctx, self.pool.clock
            self.last_draft.pop(sid, None)
            self.acceptance.forget(sid)
            self.jobs = [j for j in self.jobs if j.slot_id != sid]
            self.jobs.append(_Job(sid, ctx, prompt_depth(self.policy.budget, self.policy.k)))
            queued += 1
        self.stats.prefetched_prompts += queued
        return queued

    def _plan_jobs(self, rows: list[_Row], out, p_served: dict, cost: TargetCost,
                   batch: int) -> None:
        """Queue the next step's pre-draft (the controller's plan): ``out`` is each row's
        served draft, ``p_served`` its root (:meth:`DuoDrafter._served`)."""
        self.jobs = []
        self.planned = set()  # slots with a pre-draft queued for the next step
        policy = self.policy
        if not policy.predrafts:
            return
        rows = [r for r in rows if len(r.ctx) + len(out[r.row]) + 2 < self.n_ctx]
        ending = {r.row for r in rows if ends_at_root(p_served[r.row][0], r.remaining)}
        if ending:  # their last step is under way: the draft side goes idle, not pre-drafts
            self.stats.short_lived += len(ending)
            rows = [r for r in rows if r.row not in ending]
        roots = [p_served[r.row] for r in rows]
        # the root: the context and the served draft, or a part of it
        prefixes = [np.concatenate([r.ctx, np.asarray(out[r.row][:root[0]], dtype=np.int32)])
                    for r, root in zip(rows, roots)]
        if policy.budget is not None:
            depths = [policy.budget] * len(rows)
        else:
            catch_up = [predraft_catch_up(len(p) - common_prefix_len(r.slot.tokens, p),
                                          r.background) for r, p in zip(rows, prefixes)]
            depths = plan_predraft([r.alpha for r in rows],
                                   [root[1] * r.alpha for r, root in zip(rows, roots)],
                                   [r.k for r in rows], catch_up, self.expected_step_s,
                                   self.draft_time, min_gain=cost.threshold(batch))
            prefill_s = self._prefill_token_s()
            for i, r in enumerate(rows):
                if depths[i] == 0 and probe_due(self.quiet.get(r.slot.seq_id, 0)) \
                        and probe_affordable(r.catch_up, prefill_s, cost.t0):
                    depths[i] = 1
                    self.stats.probes += 1
                # a request that ends before the draft could catch up: left to the target
                if depths[i] and r.background and not catch_up_pays(
                        r.catch_up, prefill_s, r.remaining, cost.t0):
                    depths[i] = 0
                    self.stats.short_lived += 1
        for r, p, m in zip(rows, prefixes, depths):
            if m > 0:  # a request planned no draft is not even caught up
                self.jobs.append(_Job(r.slot.seq_id, p, m, r.temperature))
                self.stats.hedged_roots += len(p) < len(r.ctx) + len(out[r.row])
        self.planned = {job.slot_id for job in self.jobs}

    # -- ahead of time, while vLLM verifies ------------------------------------
    def deadline_after(self, returned_at: float) -> float | None:
        """When the pre-draft should be done: when vLLM is expected back (auto budget)."""
        return predraft_deadline(returned_at, self.expected_step_s, self.policy.budget is not None)

    def predraft(self, interrupt=lambda: False, deadline: float | None = None) -> None:
        """Run the queued jobs, till ``interrupt()``; branches also stop before a decode
        call that would overrun ``deadline`` (``perf_counter``), prompt prefills don't."""
        jobs, self.jobs = self.jobs, []
        if not jobs:
            return
        t0 = time.perf_counter()

        def stop(width: int) -> bool:
            """Stop before a decode call of ``width`` tokens that would end past the deadline."""
            return interrupt() or call_overruns(time.perf_counter(), self.draft_time(width),
                                                deadline)
        try:
            self._predraft(jobs, interrupt, stop)
        except Exception:
            self._recover([self.pool.slots[j.slot_id] for j in jobs])
        self.stats.busy_s += time.perf_counter() - t0

    def _predraft(self, jobs: list[_Job], interrupt, stop) -> None:
        """Grow trees for the jobs caught up; prefill the others (new prompts) in shared
        chunks, so no request waits behind another's prompt."""
        slots = {job.slot_id: self.pool.slots[job.slot_id] for job in jobs}
        for job in jobs:
            self._sync_slot(slots[job.slot_id], job.prefix)
        while jobs:
            behind = [len(job.prefix) - len(slots[job.slot_id].tokens) for job in jobs]
            ready = [job for job, n in zip(jobs, behind) if not needs_prefill(n)]
            jobs = [job for job, n in zip(jobs, behind) if needs_prefill(n)]
            if ready:
                self._grow_trees(ready, [slots[job.slot_id] for job in ready], stop)
            if not jobs:
                return
            if interrupt():
                self.stats.interrupted += 1  # the prefill goes on next time, from where it is
                return
            self._prefill_chunk(jobs, slots)

    def _prefill_chunk(self, jobs: list[_Job], slots: dict) -> None:
        """One decode call of a chunk of prompt tokens, shortest prompt first; each
        prompt's last token is left for the tree growing (the first branch point)."""
        others = self.live - {job.slot_id for job in jobs}
        room = prefill_chunk(bool(others), self.expected_step_s or self.target_step_s
                             or PRIOR_STEP_S, self._prefill_token_s())
        items, owners = [], []
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

    def _grow_trees(self, jobs: list[_Job], slots: list, stop) -> None:
        st, policy = self.stats, self.policy
        # 1. catch up: evaluate the tail of the returned draft (one decode call)
        items = [(slot.seq_id, job.prefix[len(slot.tokens):], len(slot.tokens))
                 for job, slot in zip(jobs, slots)]
        logits, n = self._decode(items)
        st.predraft_tokens += n
        tops = [top_candidates(_tempered(lg, job.temperature)) for job, lg in zip(jobs, logits)]
        trees = []
        for job, slot, (ids, _) in zip(jobs, slots, tops):
            slot.tokens = job.prefix
            trees.append(Tree(job.prefix, [Branch([int(ids[0])], slot.seq_id)]))
            self.trees[slot.seq_id] = trees[-1]
        grow = [i for i, job in enumerate(jobs) if job.evals > 0]  # planned depth 0: caught up
        jobs, slots, trees, tops = ([x[i] for i in grow] for x in (jobs, slots, trees, tops))
        if not jobs:
            return
        if stop(len(jobs)):
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
                _, p2_probs = top_candidates(_tempered(lg, job.temperature), 1)
                first = branch_candidates(ids, probs, float(p2_probs[0]), policy.max_branches)
            else:
                first = [main.tokens[0]]
            self._extend(main, lg, job.temperature)
            weights = [float(probs[list(ids).index(t)]) for t in first]
            alpha = self.acceptance.alpha(slot.seq_id, regime(job.temperature))
            alloc = split_budget(job.evals, weights, cap=policy.k, alpha=alpha)
            alloc[0] = max(alloc[0], 1)  # the top-1 candidate is already evaluated once
            left = [alloc[0] - 1]
            for j, (tok, a) in enumerate(zip(first[1:], alloc[1:]), start=1):
                if a <= 0:
                    continue
                seq = self._branch_seq(slot.seq_id, j)
                self.backend.remove(seq, 0, -1)
                self.backend.copy(slot.seq_id, seq, 0, len(tree.prefix))
                tree.branches.append(Branch([tok], seq))
                left.append(a)
            st.branch_counts[len(tree.branches)] += 1
            evals_left.append(left)
        # 3. extend every branch greedily, all branches of all requests in one decode
        while True:
            items, owners = [], []
            for job, slot, tree, left in zip(jobs, slots, trees, evals_left):
                for j, br in enumerate(tree.branches):
                    if left[j] <= 0:
                        continue
                    pos = len(tree.prefix) + len(br.tokens) - 1
                    if pos + 2 >= self.n_ctx:
                        left[j] = 0
                        continue
                    items.append((br.seq_id, np.array(br.tokens[-1:], dtype=np.int32), pos))
                    owners.append((br, left, j, slot, job.temperature))
            if not items:
                return
            if stop(len(items)):
                st.interrupted += 1
                return
            logits, n = self._decode(items)
            st.predraft_tokens += n
            for (br, left, j, slot, temp), lg in zip(owners, logits):
                if br.seq_id == slot.seq_id:
                    slot.tokens = np.append(slot.tokens, np.int32(br.tokens[-1]))
                self._extend(br, lg, temp)
                left[j] -= 1


def _tempered(logits: np.ndarray, temperature: float) -> np.ndarray:
    """The logits a request samples from: scaled by its temperature (greedy: as they are)."""
    return logits if temperature < 1e-5 else logits / np.float32(temperature)
