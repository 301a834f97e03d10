"""The drafter: chains on demand, branch trees ahead of time, state matched by prefix.

``propose`` answers one vLLM step: per request it serves a branch pre-drafted
during the previous step (a *hit*) or drafts a chain from the context while
vLLM waits (a *miss*), as many tokens as the goodput controller plans
(:mod:`duo_vllm.control`). It then queues the next step's pre-draft
(:mod:`duo_vllm.draft.predraft`), run while vLLM verifies. vLLM verifies
everything, so drafts change speed, never output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from duo_vllm.control.drafting import (
    PRIOR_STEP_S, assumed_cost, floor_streak_after, lookup_fallback, needs_prefill,
    prefill_in_background, probe_due, sync_catch_up,
)
from duo_vllm.control.goodput import (
    TargetCost, expected_accepted, plan_served, plan_sync, predraft_root, regime,
)
from duo_vllm.draft.branching import Branch, Tree, miss_reason, select_branch
from duo_vllm.draft.predraft import Predrafter
from duo_vllm.draft.sequences import DraftPolicy
from duo_vllm.draft.slots import Slot, common_prefix_len
from duo_vllm.runtime.message import StepRequest
from duo_vllm.control.serving import Hint, alpha_of, serve as serve_rule

__all__ = ["DraftPolicy", "DuoDrafter"]


@dataclass
class _Row:
    """One request of a step, as the drafter sees it."""

    row: int
    slot: Slot
    ctx: np.ndarray
    k: int
    temperature: float
    alpha: float
    tree: Tree | None
    branch: Branch | None  # the pre-drafted branch that continues ctx (a hit)
    catch_up: int  # tokens to evaluate before drafting (a miss)
    background: bool  # a miss too far behind to draft now: prefilled in the background
    remaining: int | None = None  # tokens the request may still generate (None: unknown)

    @property
    def follow(self) -> int:
        """Tokens of its branch the context already holds (a hit; 1 otherwise)."""
        return len(self.ctx) - len(self.tree.prefix) if self.branch is not None else 1

    @property
    def available(self) -> int:
        return min(self.k, len(self.branch.tokens) - self.follow) if self.branch else 0


class DuoDrafter(Predrafter):
    """Drafts for batches of contexts: executes :mod:`duo_vllm.control`'s plans, and owns
    the draft state (slots, trees, the llama.cpp calls)."""

    def propose(self, step: StepRequest, serve: bool = True) -> list[list[int]]:
        """Drafts for one step (fields: :class:`StepRequest`); queues the next pre-draft,
        from the end of what the proposer will serve (this draft or the row's lookup hint).
        With ``serve=False`` (vLLM went on without a draft) only the pre-draft is queued."""
        t0 = time.perf_counter()
        st = self.stats
        st.steps += 1
        if st.started is None:
            st.started = time.monotonic()
        if step.step_s:
            self.target_step_s = step.step_s
        if step.per_token_s is not None:
            self.per_token_s = step.per_token_s
        cost = assumed_cost(self.target_step_s, self.per_token_s)
        contexts = [np.asarray(c, dtype=np.int32) for c in step.contexts]
        temps = [0.0] * len(contexts) if step.temperatures is None else \
            [float(x) for x in step.temperatures]
        out: list[list[int]] = [[] for _ in contexts]
        qs: dict = {}  # row -> the q of each token of its draft, where all were drawn
        rows = self._rows(contexts, step.budgets, temps, serve, step.remaining)
        hits = [r for r in rows if r.branch is not None]
        misses = [r for r in rows if r.branch is None and not r.background]
        served, (chosen, depth) = self._plan_step(len(contexts), hits, misses, cost, step.hints)
        for r, n in zip(hits, served):
            out[r.row], qs[r.row] = self._take_branch(r.slot, r.tree, r.branch, n, r.follow)
            st.deep_hits += r.follow > 1
            st.predraft_hits += 1
            if not r.available:  # its branch holds the target's token only: nothing to serve
                st.misses["shallow"] += 1
            st.branch_hits[r.tree.branches.index(r.branch)] += 1
        if chosen and depth > 0:  # each chosen miss drafts ``depth`` tokens from its context
            t_sync = time.perf_counter()
            self._draft_chains(chosen, depth, out, qs)
            st.sync_s += time.perf_counter() - t_sync
            st.sync_calls += 1
        self.live = {r.slot.seq_id for r in rows}
        self.last_q = [qs.get(i) if out[i] else None for i in range(len(out))]
        for r in rows:
            draft = out[r.row]
            self.last_draft[r.slot.seq_id] = (len(r.ctx), draft, regime(r.temperature))
            st.returned_tokens += len(draft)
            st.chosen_lengths[len(draft)] += 1
            self.quiet[r.slot.seq_id] = 0 if draft else self.quiet.get(r.slot.seq_id, 0) + 1
        asked = serve and bool(hits or misses)
        drafted = any(out[r.row] for r in rows)
        st.floor_steps += asked and not drafted
        self.floor_streak = floor_streak_after(self.floor_streak, asked, drafted)
        served, p_served = self._served(rows, out, step.hints, self.last_q)
        self.expected_step_s = cost.step(sum(len(d) for d in served))
        self._plan_jobs(rows, served, p_served, cost, len(contexts))
        st.busy_s += time.perf_counter() - t0
        return out

    def _served(self, rows: list[_Row], out, hints, qs):
        """What the proposer will serve per row, and per row the pre-draft's root in it
        (:func:`~duo_vllm.control.goodput.predraft_root`)."""
        served = list(out)
        p_all = {r.row: (len(out[r.row]), r.alpha ** len(out[r.row])) for r in rows}
        for r in rows:
            hint = _hint(hints, r.row)
            if hint is None:
                continue
            draft, source = serve_rule(out[r.row], qs[r.row] is not None, hint)
            if list(draft) != list(out[r.row]):
                agree = common_prefix_len(np.asarray(draft, dtype=np.int32),
                                          np.asarray(out[r.row], dtype=np.int32))
                served[r.row] = list(draft)
                p_all[r.row] = predraft_root(len(draft), agree, r.alpha,
                                             alpha_of(hint, source),
                                             greedy=r.temperature < 1e-5)
                self.stats.lookup_predrafts += 1
        return served, p_all

    def _rows(self, contexts, max_tokens, temps, serve: bool, remaining=None) -> list[_Row]:
        """Match each request to its slot; find its pre-drafted branch, or what it lacks."""
        st, policy = self.stats, self.policy
        rows = []
        left = [None] * len(contexts) if remaining is None else remaining
        for row, (ctx, k, a, temp) in enumerate(zip(contexts, max_tokens,
                                                    self._assign(contexts), temps)):
            if a is not None and self.pool.window and len(a.view) + policy.k + 2 >= self.n_ctx:
                a = self._slide(a.slot, ctx)  # the window is full: a new one, further on
            if a is not None:
                ctx = a.view  # from here on, the context as the slot holds it
            k = min(int(k), policy.k, self.n_ctx - len(ctx) - 1)
            if k <= 0 or len(ctx) == 0:
                continue
            if a is None:
                st.no_slot += 1
                continue
            st.requests += 1
            slot = a.slot
            # the request came: named by its context, not by a prompt that would outlive it
            slot.seen, slot.queued = ctx, None
            reg = regime(temp)
            self._observe_acceptance(slot, ctx, a.reuse, reg)
            tree = self.trees.get(slot.seq_id)
            if tree is not None:
                st.predraft_lookups += 1
            branch = select_branch(tree, ctx) if serve else None
            catch_up, background = 0, False
            if serve and branch is None:
                why = miss_reason(tree, ctx)
                if why == "no_tree":
                    why = "cut" if slot.seq_id in self.planned else "unplanned"
                st.misses[why] += 1
            if branch is None:
                self._clear_tree(slot.seq_id)
                catch_up = len(ctx) - a.reuse
                background = not serve or (policy.predrafts and prefill_in_background(
                    catch_up, len(contexts), self.target_step_s or PRIOR_STEP_S,
                    self._prefill_token_s(), policy.k))
                if background and needs_prefill(catch_up):
                    slot.queued = ctx  # a prompt for the background: the slot's name till then
                    slot.queued_at = self.pool.clock
            rows.append(_Row(row, slot, ctx, k, temp, self.acceptance.alpha(slot.seq_id, reg),
                             tree, branch, catch_up, background, left[row]))
        return rows

    def _plan_step(self, batch: int, hits: list[_Row], misses: list[_Row], cost: TargetCost,
                   hints):
        """Tokens served per hit; the misses drafted now, and the depth drafted for each."""
        policy = self.policy
        if policy.budget is not None:  # fixed: every hit in full, every miss to the budget
            return [r.available for r in hits], (misses, min(policy.budget, policy.k))
        served = plan_served([r.alpha for r in hits], [r.available for r in hits], cost,
                             base_tokens=batch)
        for i, r in enumerate(hits):
            if served[i] == 0 and r.available and probe_due(self.quiet.get(r.slot.seq_id, 0)):
                served[i] = 1
                self.stats.probes += 1
        if not misses:
            return served, ([], 0)
        # a miss with a lookup draft is served that copy if nothing is drafted for it now
        fallback = [lookup_fallback(_hint(hints, r.row)) for r in misses]
        base_tokens = batch + sum(expected_accepted(r.alpha, n) for r, n in zip(hits, served)) \
            + sum(t for t, _ in fallback)
        catch_up = [sync_catch_up(r.catch_up, policy.predrafts) for r in misses]
        plan = plan_sync([r.alpha for r in misses], [r.k for r in misses], catch_up, cost,
                         self.draft_time, base_tokens,
                         sum(served) + sum(n for _, n in fallback), fallback)
        if not plan.rows and not policy.predrafts:
            # no pre-draft probes without a background thread: probe the quietest miss here
            quiet = max(misses, key=lambda r: self.quiet.get(r.slot.seq_id, 0))
            if probe_due(self.quiet.get(quiet.slot.seq_id, 0)):
                self.stats.probes += 1
                return served, ([quiet], 1)
        self.stats.lookup_misses += sum(1 for i, (_, n) in enumerate(fallback)
                                        if n and i not in plan.rows)
        return served, ([misses[i] for i in plan.rows], plan.depth)

    def _take_branch(self, slot, tree: Tree, branch: Branch, n: int, follow: int):
        """Adopt a pre-drafted branch as the request's sequence; return its ``n`` draft
        tokens after the ``follow`` the context holds, and their q (None unless drawn)."""
        pos_b = len(tree.prefix)
        if branch.seq_id != slot.seq_id:
            self.backend.remove(slot.seq_id, pos_b, -1)
            self.backend.copy(branch.seq_id, slot.seq_id, pos_b, -1)
        evaluated = branch.tokens[:-1] if len(branch.tokens) > 1 else []
        slot.tokens = np.concatenate([tree.prefix[:pos_b], np.asarray(evaluated, dtype=np.int32)])
        self._clear_tree(slot.seq_id)
        draft = list(branch.tokens[follow:follow + n])
        return draft, branch.drawn(len(draft), follow - 1)

    def _draft_chains(self, rows: list[_Row], depth: int, out, qs: dict) -> None:
        """Chains of up to ``depth`` tokens from the rows' contexts, all decoded together;
        the drawn tokens' q go to ``qs``."""
        items = []
        for r in rows:
            keep = self._sync_slot(r.slot, r.ctx)
            items.append((r.slot.seq_id, r.ctx[keep:], keep))
            self.stats.prefill_tokens += len(r.ctx) - keep
            r.slot.tokens = r.ctx
            qs[r.row] = []
        live = rows
        try:
            logits, _ = self._decode(items)
            while live:
                items, still = [], []
                for r, lg in zip(live, logits):
                    tok, q = self._next_token(lg, r.temperature)
                    out[r.row].append(tok)
                    qs[r.row] = None if qs[r.row] is None or q is None else qs[r.row] + [q]
                    if len(out[r.row]) < min(depth, r.k):
                        items.append((r.slot.seq_id, np.array([tok], dtype=np.int32),
                                      len(r.slot.tokens)))
                        r.slot.tokens = np.append(r.slot.tokens, np.int32(tok))
                        still.append(r)
                if not items:
                    break
                logits, n = self._decode(items)
                self.stats.sync_tokens += n
                live = still
        except Exception:
            self._recover([r.slot for r in rows])
            for r in rows:
                out[r.row], qs[r.row] = [], None


def _hint(hints: list[Hint | None] | None, row: int) -> Hint | None:
    """Row ``row``'s lookup hint, if the proposer sent one."""
    return hints[row] if hints is not None and row < len(hints) else None
