"""The drafter: chains on demand, branch trees ahead of time, state matched by prefix.

``propose`` answers one vLLM step. For each request it either serves a branch
pre-drafted during the previous step (a *hit*: no draft compute on the
critical path) or drafts a chain from the real context while vLLM waits
(a *miss*); how many tokens each request gets, zero included, is the goodput
controller's choice (:mod:`duo_vllm.control.goodput`), and the rest of what
the drafter does is decided by :mod:`duo_vllm.control.drafting`. It then
queues the next step's *pre-draft* (:mod:`duo_vllm.draft.predraft`), which
runs while vLLM verifies. The state it all works on, and the backend's
calls, are :mod:`duo_vllm.draft.sequences`'.

Each branch grows along the draft's top-1 token, or, for a sampled request
(``sampled_drafts``), along tokens drawn from the draft's own distribution q,
returned with the draft so the rejection sampler can use it
(:mod:`duo_vllm.draft.sampling`). vLLM's rejection sampler verifies everything, so
drafts change speed, never output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from duo_vllm.control.drafting import (
    PRIOR_STEP_S, floor_streak_after, lookup_fallback, needs_prefill,
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
    """Drafts for batches of contexts on a multi-sequence backend
    (:mod:`duo_vllm.draft.backend`).

    It executes the plans of :mod:`duo_vllm.control` and owns the draft state
    (slots, trees, the llama.cpp calls); the decisions are the controller's.
    """

    # -- one vLLM step ---------------------------------------------------------
    def propose(self, step: StepRequest, serve: bool = True) -> list[list[int]]:
        """Drafts for one step; queues the pre-draft of the next when ``parallel``.

        ``step.step_s`` and ``step.per_token_s`` are the target's T₀(B) and c
        for this batch (measured by the proposer); ``step.temperatures`` each
        request's sampling temperature (0: greedy). With ``serve=False``
        nothing is drafted now (vLLM has already gone on without a draft):
        only the pre-draft for these contexts is queued. ``step.hints`` are the
        proposer's lookup drafts (:class:`duo_vllm.control.serving.Hint`): the drafter
        returns its own drafts, and pre-drafts from the end of what the
        proposer will serve, :func:`duo_vllm.control.serving.serve` of its own draft
        and the hint (the same pure function, the same inputs), so a served
        lookup continuation finds its next step's branches ready.
        ``step.remaining``: the tokens each request may still generate (its
        ``max_tokens`` left), where the proposer knows them.
        """
        t0 = time.perf_counter()
        st = self.stats
        st.steps += 1
        if st.started is None:
            st.started = time.monotonic()
        if step.step_s:
            self.target_step_s = step.step_s
        if step.per_token_s is not None:
            self.per_token_s = step.per_token_s
        cost = self._cost()
        hints = step.hints
        contexts = [np.asarray(c, dtype=np.int32) for c in step.contexts]
        temps = [0.0] * len(contexts) if step.temperatures is None else \
            [float(x) for x in step.temperatures]
        out: list[list[int]] = [[] for _ in contexts]
        qs: dict = {}  # row -> the q of each token of its draft, where all were drawn
        rows = self._rows(contexts, step.budgets, temps, serve, step.remaining)
        hits = [r for r in rows if r.branch is not None]
        misses = [r for r in rows if r.branch is None and not r.background]
        served, (chosen, depth) = self._plan_step(len(contexts), hits, misses, cost, hints)
        for r, n in zip(hits, served):
            out[r.row], qs[r.row] = self._take_branch(r.slot, r.tree, r.branch, n, r.follow)
            st.deep_hits += r.follow > 1
            st.predraft_hits += 1
            if not r.available:  # its branch holds the target's token only: nothing to serve
                st.misses["shallow"] += 1
            st.branch_hits[r.tree.branches.index(r.branch)] += 1
        if chosen and depth > 0:  # each chosen miss drafts ``depth`` tokens from its context
            t_sync = time.perf_counter()
            chains = [(r.row, r.slot, min(depth, r.k), r.temperature) for r in chosen]
            self._draft_chains(chains, {r.row: r.ctx for r in chosen}, out, qs)
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
        served, p_served = self._served(rows, out, hints, self.last_q)
        self.expected_step_s = cost.step(sum(len(d) for d in served))
        self._plan_jobs(rows, served, p_served, cost, len(contexts))
        st.busy_s += time.perf_counter() - t0
        return out

    def _served(self, rows: list[_Row], out, hints, qs):
        """What the proposer will serve per row, and where the next step most likely
        starts: per row, the tokens of the served draft the pre-draft's root holds
        and the chance the target's tokens reach that root
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
            # the request came: its slot is named by what it is seen at, and is kept for it
            # while it runs; a prompt name queued by prefetch would hold the slot for
            # QUEUED_TTL assign() calls past the request's end
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
                   hints=None):
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
            # (one token), so measured costs and acceptance replace the priors
            quiet = max(misses, key=lambda r: self.quiet.get(r.slot.seq_id, 0))
            if probe_due(self.quiet.get(quiet.slot.seq_id, 0)):
                self.stats.probes += 1
                return served, ([quiet], 1)
        self.stats.lookup_misses += sum(1 for i, (_, n) in enumerate(fallback)
                                        if n and i not in plan.rows)
        return served, ([misses[i] for i in plan.rows], plan.depth)

    def _take_branch(self, slot, tree: Tree, branch: Branch, n: int, follow: int = 1):
        """Adopt a pre-drafted branch as the request's sequence; return ``n`` draft
        tokens after the ``follow`` the context holds and their q (None unless each
        was drawn)."""
        pos_b = len(tree.prefix)
        if branch.seq_id != slot.seq_id:
            self.backend.remove(slot.seq_id, pos_b, -1)
            self.backend.copy(branch.seq_id, slot.seq_id, pos_b, -1)
        evaluated = branch.tokens[:-1] if len(branch.tokens) > 1 else []
        slot.tokens = np.concatenate([tree.prefix[:pos_b], np.asarray(evaluated, dtype=np.int32)])
        self._clear_tree(slot.seq_id)
        draft = list(branch.tokens[follow:follow + n])
        return draft, branch.drawn(len(draft), follow - 1)

    def _draft_chains(self, misses, contexts: dict, out, qs: dict) -> None:
        """Chains from the real contexts (by row, as the slots hold them), all requests
        decoded together: (row, slot, length, temperature) each; the drawn tokens' q
        go to ``qs``."""
        live, items = [], []
        for row, slot, n, temp in misses:
            ctx = contexts[row]
            keep = self._sync_slot(slot, ctx)
            items.append((slot.seq_id, ctx[keep:], keep))
            self.stats.prefill_tokens += len(ctx) - keep
            slot.tokens = ctx
            live.append([row, slot, n, temp])
            qs[row] = []
        try:
            logits, _ = self._decode(items)
            while live:
                nxt_items, still = [], []
                for (row, slot, n, temp), lg in zip(live, logits):
                    tok, q = self._next_token(lg, temp)
                    out[row].append(tok)
                    qs[row] = None if qs[row] is None or q is None else qs[row] + [q]
                    if len(out[row]) < n:
                        tok = out[row][-1]
                        nxt_items.append((slot.seq_id, np.array([tok], dtype=np.int32),
                                          len(slot.tokens)))
                        slot.tokens = np.append(slot.tokens, np.int32(tok))
                        still.append([row, slot, n, temp])
                if not nxt_items:
                    break
                logits, n_tok = self._decode(nxt_items)
                self.stats.sync_tokens += n_tok
                live = still
        except Exception:
            self._recover([slot for _, slot, _, _ in misses])
            for row, _, _, _ in misses:
                out[row], qs[row] = [], None


def _hint(hints: list[Hint | None] | None, row: int) -> Hint | None:
    """Row ``row``'s lookup hint, if the proposer sent one."""
    return hints[row] if hints is not None and row < len(hints) else None
