"""The drafter: chains on demand, branch trees ahead of time, state matched by prefix.

``propose`` answers one vLLM step. For each request it either serves a branch
pre-drafted during the previous step (a *hit*: no draft compute on the
critical path) or drafts a chain from the real context while vLLM waits
(a *miss*); how many tokens each request gets, zero included, is the goodput
controller's choice (:mod:`duo_vllm.control.goodput`). It then queues *pre-draft* jobs:
assume the draft just returned will be fully accepted, and prepare, for the
token the target samples after it, one branch per likely candidate
(DuoDecoding's dynamic multi-sequence drafting). ``predraft`` runs those jobs
while vLLM verifies, and stops early when ``interrupt()`` says the next step
has arrived.

Each branch grows along the draft's top-1 token, or, for a sampled request
(``sampled_drafts``), along tokens drawn from the draft's own distribution q,
returned with the draft so the rejection sampler can use it
(:mod:`duo_vllm.draft.sampling`). vLLM's rejection sampler verifies everything, so
drafts change speed, never output.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from duo_vllm.draft.branching import (
    Branch, Tree, branch_candidates, miss_reason, runner_up, select_branch, split_budget,
    top_candidates,
)
from duo_vllm.sources.lookup import Hint, serve as serve_rule
from duo_vllm.control.drafting import (
    MAX_HEDGES, PRIOR_PREFILL_S, PRIOR_STEP_S, assumed_cost, call_overruns, extends_branch,
    floor_streak_after, hedges_on, lookup_fallback, needs_prefill, pick_hedges,
    predraft_catch_up, predraft_deadline, prefill_chunk, prefill_in_background,
    prefills_prompts, probe_affordable, probe_due, prompt_depth, reroot_candidates,
    restore_pays, sync_catch_up,
)
from duo_vllm.control.goodput import (
    Acceptance, DraftTimeModel, TargetCost, catch_up_pays, expected_accepted, plan_predraft,
    plan_served, plan_sync, predraft_roots, regime,
)
from duo_vllm.draft.sampling import draft_q, sample_q
from duo_vllm.draft.prompt_cache import PromptCache
from duo_vllm.draft.slots import Assignment, Slot, SlotPool, common_prefix_len, pool_window, window_view
from duo_vllm.runtime.message import StepRequest
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
    # sampled requests' drafts drawn from the draft's q, which the verifier then reads
    # (duo_vllm/draft/sampling.py); False: the argmax, as for greedy ones
    sampled_drafts: bool = False
    vocab_limit: int | None = None  # drawn tokens stay below it (the target's vocabulary)

    @property
    def predrafts(self) -> bool:
        """Does anything run in the background (pre-drafts, prefills)?"""
        return self.parallel and self.budget != 0


@dataclass
class _Job:
    slot_id: int
    prefix: np.ndarray  # context + the draft just returned
    evals: int  # draft tokens the pre-draft grows for this request (its planned depth)
    temperature: float = 0.0
    # (root, token, p, evals) each: a branch on the draft's runner-up ``token`` after
    # ``prefix[:root]``, reached with probability p (goodput.hedge_probs), ``evals`` deep
    hedges: list = field(default_factory=list)


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
        return len(self.ctx) - self.tree.root_of(self.branch) if self.branch is not None else 1

    @property
    def available(self) -> int:
        return min(self.k, len(self.branch.tokens) - self.follow) if self.branch else 0


class DuoDrafter:
    """Drafts for batches of contexts on a multi-sequence backend (see backends/).

    It executes the goodput controller's plan (:mod:`duo_vllm.control.goodput`) and
    owns the draft state; the decisions are the controller's.
    """

    def __init__(self, backend, max_sequences: int, n_ctx: int, policy: DraftPolicy,
                 window: int | None = None, seed: int | None = None, cache_bytes: int = 0):
        self.backend, self.n_ctx, self.policy = backend, n_ctx, policy
        # the KV of requests whose slot went to another, for when they come back
        self.cache = PromptCache(cache_bytes) if cache_bytes > 0 else None
        self.rng = np.random.default_rng(seed)  # the draws of sampled drafts
        self.last_q: list = []  # each row's q of its last draft (None: not drawn)
        self.pool = SlotPool(max_sequences, window=pool_window(window, n_ctx))
        self.n_extra = max(policy.max_branches - 1, 0)
        self.hedging = hedges_on(policy.predrafts, policy.budget is None, policy.multi_sequence,
                                 self.n_extra)
        self.trees: dict[int, Tree] = {}
        self.last_draft: dict[int, tuple[int, list[int], str]] = {}
        self.jobs: list[_Job] = []
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
        self.floor_streak = 0  # consecutive steps the controller drafted nothing

    # -- backend calls, timed --------------------------------------------------
    def _decode(self, items):
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
        """Measure D(w) for the narrow widths a pre-draft uses, before the first request.

        Without it the first calls measured may be one prompt's prefill chunks
        alone (64 tokens: 159 ms), D(1) is read off them (80 ms, against 10
        measured), no pre-draft fits a target step, and no narrow call ever
        runs to correct it: on long-prompt work the draft model then drafted
        nothing at all. Runs on slot 0's sequence, emptied after; the first
        call (``warm_tokens``, untimed) warms the draft up. Returns D by width.
        """
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

    def _draws(self, temperature: float) -> bool:
        """Are this request's draft tokens drawn from q (else the argmax)?"""
        return self.policy.sampled_drafts and temperature >= 1e-5

    def _next_token(self, logits: np.ndarray, temperature: float):
        """The next draft token and its q: drawn from q for a sampled request (with
        ``sampled_drafts``), else the argmax (q None)."""
        if self._draws(temperature):
            q = draft_q(logits, temperature, limit=self.policy.vocab_limit)
            return sample_q(*q, self.rng), q
        return int(np.argmax(logits)), None

    def _extend(self, branch: Branch, logits: np.ndarray, temperature: float) -> None:
        """Grow ``branch`` by the draft token after its last (and keep its q, or, for a
        greedy request, its runner_up(), where a hedge may root next step)."""
        tok, q = self._next_token(logits, temperature)
        branch.tokens.append(tok)
        branch.q.append(q)
        branch.alts.append(runner_up(logits, tok) if self.hedging and temperature < 1e-5
                           else None)

    def _sync_slot(self, slot, ctx: np.ndarray) -> int:
        """Make the slot's main sequence hold ``ctx[:keep]``; return keep (< len(ctx))."""
        keep = min(common_prefix_len(slot.tokens, ctx), len(ctx) - 1)
        self.backend.remove(slot.seq_id, keep, -1)
        slot.tokens = slot.tokens[:keep]
        self.stats.reused_tokens += keep
        return keep

    def _cost(self) -> TargetCost:
        return assumed_cost(self.target_step_s, self.per_token_s)

    def _prefill_token_s(self) -> float:
        return self.prefill_s.get(PRIOR_PREFILL_S)

    # -- one vLLM step ---------------------------------------------------------
    def propose(self, step: StepRequest, serve: bool = True) -> list[list[int]]:
        """Drafts for one step; queues the pre-draft of the next when ``parallel``.

        ``step.step_s`` and ``step.per_token_s`` are the target's T₀(B) and c
        for this batch (measured by the proposer); ``step.temperatures`` each
        request's sampling temperature (0: greedy). With ``serve=False``
        nothing is drafted now (vLLM has already gone on without a draft):
        only the pre-draft for these contexts is queued. ``step.hints`` are the
        proposer's lookup drafts (:class:`duo_vllm.sources.lookup.Hint`): the drafter
        returns its own drafts, and pre-drafts from the end of what the
        proposer will serve, :func:`duo_vllm.sources.lookup.serve` of its own draft
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
        alts: dict = {}  # row -> each token of its draft's runner_up() (greedy rows)
        rows = self._rows(contexts, step.budgets, temps, serve, step.remaining)
        hits = [r for r in rows if r.branch is not None]
        misses = [r for r in rows if r.branch is None and not r.background]
        served, (chosen, extend, depth) = self._plan_step(len(contexts), hits, misses, cost,
                                                          hints)
        for r, n in zip(hits, served):
            out[r.row], qs[r.row], alts[r.row] = self._take_branch(r.slot, r.tree, r.branch, n,
                                                                   r.follow)
            st.deep_hits += r.follow > 1
            st.hedge_hits += r.branch.root is not None
            st.predraft_hits += 1
            if not r.available:  # its branch holds the target's token only: nothing to serve
                st.misses["shallow"] += 1
            st.branch_hits[r.tree.branches.index(r.branch)] += 1
        if (chosen or extend) and depth > 0:
            t_sync = time.perf_counter()
            # a miss drafts ``depth`` tokens from its context; a hit whose branch ran out,
            # ``depth`` more from the end of what it serves
            chains = [(r.row, r.slot, min(depth, r.k), r.temperature) for r in chosen]
            chains += [(r.row, r.slot, min(len(out[r.row]) + depth, r.k), r.temperature)
                       for r in extend]
            roots = {r.row: r.ctx for r in chosen}
            roots.update({r.row: np.concatenate([r.ctx, np.asarray(out[r.row], dtype=np.int32)])
                          for r in extend})
            self._draft_chains(chains, roots, out, qs, alts)
            st.sync_s += time.perf_counter() - t_sync
            st.sync_calls += 1
            st.extended += len(extend)
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
        served, p_served, shorter = self._served(rows, out, hints, self.last_q)
        self.expected_step_s = cost.step(sum(len(d) for d in served))
        # the runner-ups of the model's tokens served, where a hedge may root
        model_alts = {r.row: alts[r.row][:common_prefix_len(np.asarray(served[r.row]),
                                                            np.asarray(out[r.row]))]
                      for r in rows if r.row in alts and r.temperature < 1e-5}
        self._plan_jobs(rows, served, p_served, cost, len(contexts), shorter, model_alts)
        st.busy_s += time.perf_counter() - t0
        return out

    def _served(self, rows: list[_Row], out, hints, qs):
        """What the proposer will serve per row, and where the next step most likely
        starts: per row, the tokens of the served draft the pre-draft's root holds
        and the chance the target's tokens reach that root; and, where the root is
        after a copied tail, the root where the copy parts from the model (a
        shorter catch-up, for a step too short for the other)."""
        served = list(out)
        p_all = {r.row: (len(out[r.row]), r.alpha ** len(out[r.row])) for r in rows}
        shorter = {}
        for r in rows:
            hint = _hint(hints, r.row)
            if hint is None or not hint.tokens:
                continue
            draft, _ = serve_rule(out[r.row], qs[r.row] is not None, hint)
            if list(draft) != list(out[r.row]):
                agree = common_prefix_len(np.asarray(draft, dtype=np.int32),
                                          np.asarray(out[r.row], dtype=np.int32))
                served[r.row] = list(draft)
                roots = predraft_roots(len(draft), agree, r.alpha, hint.alpha_lookup,
                                       hedge=r.temperature < 1e-5)
                p_all[r.row] = roots[0]
                if len(roots) > 1 and roots[1][0] < roots[0][0]:
                    shorter[r.row] = roots[1]
                self.stats.lookup_predrafts += 1
        return served, p_all, shorter

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
        """Tokens served per hit; the misses drafted now, the hits extended now (those
        whose branch ran out), and the depth drafted for each."""
        policy = self.policy
        if policy.budget is not None:  # fixed: every hit in full, every miss to the budget
            return [r.available for r in hits], (misses, [], min(policy.budget, policy.k))
        served = plan_served([r.alpha for r in hits], [r.available for r in hits], cost,
                             base_tokens=batch)
        for i, r in enumerate(hits):
            if served[i] == 0 and r.available and probe_due(self.quiet.get(r.slot.seq_id, 0)):
                served[i] = 1
                self.stats.probes += 1
        # a hit served its whole branch is a miss with a head start (α^(n+1), α, ...)
        extend = [r for r, n in zip(hits, served)
                  if policy.predrafts and extends_branch(
                      n, r.available, r.k, bool(n and self._draws(r.temperature)
                                                and r.branch.drawn(n, r.follow - 1) is None))]
        if not misses and not extend:
            return served, ([], [], 0)
        # a miss with a lookup draft is served that copy if nothing is drafted for it now
        fallback = [lookup_fallback(_hint(hints, r.row)) for r in misses]
        fallback += [(0.0, 0)] * len(extend)
        base_tokens = batch + sum(expected_accepted(r.alpha, n) for r, n in zip(hits, served)) \
            + sum(t for t, _ in fallback)
        catch_up = [sync_catch_up(r.catch_up, policy.predrafts) for r in misses] \
            + [1] * len(extend)
        alphas = [r.alpha for r in misses] + [(r.alpha ** (r.available + 1), r.alpha)
                                              for r in extend]
        caps = [r.k for r in misses] + [r.k - r.available for r in extend]
        plan = plan_sync(alphas, caps, catch_up, cost, self.draft_time, base_tokens,
                         sum(served) + sum(n for _, n in fallback), fallback)
        if not plan.rows and not policy.predrafts:  # (then nothing is extended)
            # no pre-draft probes without a background thread: probe the quietest miss here
            # (one token), so measured costs and acceptance replace the priors
            quiet = max(misses, key=lambda r: self.quiet.get(r.slot.seq_id, 0))
            if probe_due(self.quiet.get(quiet.slot.seq_id, 0)):
                self.stats.probes += 1
                return served, ([quiet], [], 1)
        self.stats.lookup_misses += sum(1 for i, (_, n) in enumerate(fallback)
                                        if n and i not in plan.rows)
        m = len(misses)
        return served, ([misses[i] for i in plan.rows if i < m],
                        [extend[i - m] for i in plan.rows if i >= m], plan.depth)

    def _assign(self, contexts, live=frozenset()) -> list[Assignment | None]:
        """``pool.assign``, with the prompt cache: a slot taken afresh leaves what it held
        to the cache first, then takes the cached sequence its new context shares the
        most with, where that spares a prefill (:func:`restore_pays`)."""
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
        """``a`` with its slot holding the cached sequence that shares the most with
        ``ctx``, where one spares a prefill; else ``a`` as it is."""
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

    def prefetch(self, contexts: list[np.ndarray]) -> int:
        """Prompts the target is about to prefill: queue their evaluation.

        Called before vLLM's prefill step, so the draft evaluates the prompt
        while the target does (DuoDecoding's parallel prefill) and has branches
        for the first output token ready when that step's propose() comes.
        A prompt never takes the slot of a running request. Returns how many
        prompts were queued (none in serial mode).
        """
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

    def _observe_acceptance(self, slot, ctx: np.ndarray, reuse: int, reg: str) -> None:
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

    def _take_branch(self, slot, tree: Tree, branch: Branch, n: int, follow: int = 1):
        """Adopt a pre-drafted branch as the request's sequence; return ``n`` draft
        tokens after the ``follow`` the context holds, their q (None unless each
        was drawn) and their runner_up()."""
        pos_b = tree.root_of(branch)
        if branch.seq_id != slot.seq_id:
            self.backend.remove(slot.seq_id, pos_b, -1)
            self.backend.copy(branch.seq_id, slot.seq_id, pos_b, -1)
        evaluated = branch.tokens[:-1] if len(branch.tokens) > 1 else []
        slot.tokens = np.concatenate([tree.prefix[:pos_b], np.asarray(evaluated, dtype=np.int32)])
        self._clear_tree(slot.seq_id)
        draft = list(branch.tokens[follow:follow + n])
        return (draft, branch.drawn(len(draft), follow - 1),
                branch.served_alts(len(draft), follow - 1))

    def _draft_chains(self, misses, contexts: dict, out, qs: dict, alts: dict) -> None:
        """Chains from the real contexts (by row, as the slots hold them), all requests
        decoded together: (row, slot, length, temperature) each; the drawn tokens' q
        go to ``qs``, greedy tokens' runner_up() to ``alts``."""
        live, items = [], []
        for row, slot, n, temp in misses:
            ctx = contexts[row]
            keep = self._sync_slot(slot, ctx)
            items.append((slot.seq_id, ctx[keep:], keep))
            self.stats.prefill_tokens += len(ctx) - keep
            slot.tokens = ctx
            live.append([row, slot, n, temp])
            if not out[row]:  # a hit's served branch keeps its q and runner-ups, extended
                qs[row], alts[row] = [], []
        try:
            logits, _ = self._decode(items)
            while live:
                nxt_items, still = [], []
                for (row, slot, n, temp), lg in zip(live, logits):
                    tok, q = self._next_token(lg, temp)
                    out[row].append(tok)
                    qs[row] = None if qs[row] is None or q is None else qs[row] + [q]
                    alts[row].append(runner_up(lg, tok) if self.hedging and temp < 1e-5
                                     else None)
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
                out[row], qs[row], alts[row] = [], None, []

    def _recover(self, slots) -> None:
        logger.exception("drafting failed; the affected requests get no draft this step")
        self.stats.errors += 1
        for slot in slots:
            self.trees.pop(slot.seq_id, None)
            self.backend.remove(slot.seq_id, 0, -1)
            # every branch sequence of the slot (what _clear_tree removes, and a hedge's,
            # which holds its root's copy of the context before it joins the tree)
            for j in range(1, self.n_extra + 1):
                self.backend.remove(self._branch_seq(slot.seq_id, j), 0, -1)
            slot.tokens = np.zeros(0, dtype=np.int32)

    def _plan_jobs(self, rows: list[_Row], out, p_served: dict, cost: TargetCost,
                   batch: int, shorter: dict | None = None, alts: dict | None = None) -> None:
        """The next step's pre-draft: which requests, how deep (the controller's plan).

        ``out`` is what each row is served this step; ``p_served`` per row the
        tokens of it the pre-draft's root holds and the chance the target's
        tokens reach that root (the branches continue it); ``shorter`` per row
        whose root is after a copied tail, the root where the copy parts from
        the model: taken where the first leaves no branch room in the step (a
        catch-up of the whole copy and one level outlast it), so the next step
        finds a tree for the likelier of the other outcomes rather than none.
        ``alts`` per greedy row the runner_up() of each model token it is served:
        where the target may turn one down, a hedge (a branch on the runner-up,
        rooted before that token) competes for the step's draft time with the
        roots' branches, by the same worth per second.
        """
        self.jobs = []
        self.planned = set()  # slots with a pre-draft queued for the next step
        policy = self.policy
        if not policy.predrafts:
            return
        shorter = shorter or {}
        rows = [r for r in rows if len(r.ctx) + len(out[r.row]) + 2 < self.n_ctx]
        planned_hedges = [[] for _ in rows]
        roots = [p_served[r.row] for r in rows]

        def prefix(r, root):  # the root: the context and the served draft, or a part of it
            return np.concatenate([r.ctx, np.asarray(out[r.row][:root[0]], dtype=np.int32)])

        prefixes = [prefix(r, root) for r, root in zip(rows, roots)]
        if policy.budget is not None:
            depths = [policy.budget] * len(rows)
        else:
            def plan(prefixes, roots, hedges=()):
                catch_up = [predraft_catch_up(len(p) - common_prefix_len(r.slot.tokens, p),
                                              r.background) for r, p in zip(rows, prefixes)]
                of = [rows[i] for i, _, _, _ in hedges]  # a hedge: no catch-up of its own
                return plan_predraft([r.alpha for r in rows + of],
                                     [root[1] * r.alpha for r, root in zip(rows, roots)]
                                     + [p for *_, p in hedges],
                                     [r.k for r in rows + of], catch_up + [0] * len(hedges),
                                     self.expected_step_s, self.draft_time,
                                     min_gain=cost.threshold(batch),
                                     owners=[None] * len(rows) + [i for i, *_ in hedges])

            depths = plan(prefixes, roots)
            swap = reroot_candidates(depths, [r.background for r in rows],
                                     [r.row in shorter for r in rows])
            if swap:
                alt_roots, alt_prefixes = list(roots), list(prefixes)
                for i in swap:
                    alt_roots[i] = shorter[rows[i].row]
                    alt_prefixes[i] = prefix(rows[i], alt_roots[i])
                alt = plan(alt_prefixes, alt_roots)
                if any(alt[i] for i in swap):
                    depths, prefixes, roots = alt, alt_prefixes, alt_roots
                    self.stats.shorter_roots += sum(1 for i in swap if alt[i])
            hedges = self._hedges(rows, roots, alts or {})
            if hedges:
                both = plan(prefixes, roots, hedges)
                depths = both[:len(rows)]
                for (i, root, tok, p), m in zip(hedges, both[len(rows):]):
                    if m and depths[i]:  # a hedge rides on its request's pre-draft
                        planned_hedges[i].append((len(rows[i].ctx) + root, tok, p, m))
            prefill_s = self._prefill_token_s()
            for i, r in enumerate(rows):
                if depths[i] == 0 and probe_due(self.quiet.get(r.slot.seq_id, 0)) \
                        and probe_affordable(r.catch_up, prefill_s, cost.t0):
                    depths[i] = 1
                    self.stats.probes += 1
                # a request that ends before the draft could catch up: left to the target
                # (and its cores, lent while the draft has nothing to run)
                if depths[i] and r.background and not catch_up_pays(
                        r.catch_up, prefill_s, r.remaining, cost.t0):
                    depths[i] = 0
                    self.stats.short_lived += 1
        for r, p, m, h in zip(rows, prefixes, depths, planned_hedges):
            if m > 0:  # a request planned no draft is not even caught up
                self.jobs.append(_Job(r.slot.seq_id, p, m, r.temperature, h))
                self.stats.hedged_roots += len(p) < len(r.ctx) + len(out[r.row])
                self.stats.hedges += len(h)
        self.planned = {job.slot_id for job in self.jobs}

    def _hedges(self, rows: list[_Row], roots, alts: dict) -> list[tuple[int, int, int, float]]:
        """Hedge candidates, (row index, served tokens before it, runner-up, p) each: per
        greedy request caught up, at most ``MAX_HEDGES`` (and branch sequences to spare),
        the likeliest, at model tokens its root holds."""
        out = []
        room = min(MAX_HEDGES, self.n_extra) if self.hedging else 0
        for i, (r, root) in enumerate(zip(rows, roots)):
            a = alts.get(r.row)
            if not a or not room or r.background:
                continue
            a = a[:root[0]]
            out += [(i, j, a[j][0], p) for p, j in pick_hedges(r.alpha, a, room)]
        return out

    # -- ahead of time, while vLLM verifies ------------------------------------
    def deadline_after(self, returned_at: float) -> float | None:
        """When the pre-draft should be done: when vLLM is expected back (auto budget)."""
        return predraft_deadline(returned_at, self.expected_step_s, self.policy.budget is not None)

    def predraft(self, interrupt=lambda: False, deadline: float | None = None) -> None:
        """Run the queued pre-draft jobs.

        Stops between decode calls on ``interrupt()`` (the next step is here).
        Branches also stop growing before a decode call that would end past
        ``deadline`` (``time.perf_counter()`` clock; the call's time is D(w),
        measured), so the next step does not wait for it; prompt prefills go
        on past it.
        """
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
        """Grow branch trees for the jobs that are caught up; prefill the others.

        A job with more than ``CATCH_UP`` tokens to evaluate holds a new prompt.
        Those are prefilled in shared chunks, the shortest first, and each
        joins the tree growing once it is caught up. So a request already
        decoding never waits behind another's prompt, and no decode call
        outlasts one chunk.
        """
        slots = {job.slot_id: self.pool.slots[job.slot_id] for job in jobs}
        for job in jobs:
            self._sync_slot(slots[job.slot_id], job.prefix)
        while jobs:
            behind = [len(job.prefix) - len(slots[job.slot_id].tokens) for job in jobs]
            ready = [job for job, n in zip(jobs, behind) if not needs_prefill(n)]
            jobs = [job for job, n in zip(jobs, behind) if needs_prefill(n)]
            if ready:
                self._grow_trees(ready, [slots[job.slot_id] for job in ready], interrupt, stop)
            if not jobs:
                return
            if interrupt():
                self.stats.interrupted += 1  # the prefill goes on next time, from where it is
                return
            self._prefill_chunk(jobs, slots, self._chunk_tokens(jobs))

    def _chunk_tokens(self, prefilling: list[_Job]) -> int:
        """Prefill chunk size: short enough that decoding requests' drafts do not wait long."""
        others = self.live - {job.slot_id for job in prefilling}
        return prefill_chunk(bool(others), self.expected_step_s or self.target_step_s
                             or PRIOR_STEP_S, self._prefill_token_s())

    def _prefill_chunk(self, jobs: list[_Job], slots: dict, room: int) -> None:
        """One decode call of up to ``room`` prompt tokens, shortest prompt first.

        Each prompt's last token is left for the tree growing (its logits are
        the first branch point).
        """
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

    def _grow_trees(self, jobs: list[_Job], slots: list, interrupt, stop) -> None:
        st, policy = self.stats, self.policy
        # 1. catch up: evaluate the tail of the returned draft (usually its last
        #    token; at most CATCH_UP tokens a job, so one decode call)
        items = [(slot.seq_id, job.prefix[len(slot.tokens):], len(slot.tokens))
                 for job, slot in zip(jobs, slots)]
        logits, n = self._decode(items)
        st.predraft_tokens += n
        tops = [top_candidates(_tempered(lg, job.temperature)) for job, lg in zip(jobs, logits)]
        for job, slot in zip(jobs, slots):
            slot.tokens = job.prefix
        trees = [Tree(job.prefix, [Branch([int(ids[0])], float(p[0]), slot.seq_id)])
                 for job, slot, (ids, p) in zip(jobs, slots, tops)]
        for slot, tree in zip(slots, trees):
            self.trees[slot.seq_id] = tree
        grow = [i for i, job in enumerate(jobs) if job.evals > 0]  # planned depth 0: caught up
        jobs, slots, trees, tops = ([x[i] for i in grow] for x in (jobs, slots, trees, tops))
        if not jobs:
            return
        if stop(len(jobs) + sum(len(job.hedges) for job in jobs)):
            st.interrupted += 1
            return
        # 2. evaluate the top-1 candidate: its successor, and p2 for the θ rule; and each
        #    hedge's first token (the branch sequences after the θ rule's are theirs)
        items = [(slot.seq_id, np.array(tree.branches[0].tokens, dtype=np.int32),
                  len(tree.prefix)) for slot, tree in zip(slots, trees)]
        hedges = []
        for job, slot in zip(jobs, slots):
            mine = []
            for h, (root, tok, p, evals) in enumerate(job.hedges):
                seq = self._branch_seq(slot.seq_id, self.n_extra - h)
                self.backend.remove(seq, 0, -1)
                self.backend.copy(slot.seq_id, seq, 0, root)
                mine.append((Branch([tok], p, seq, root=root), evals))
                items.append((seq, np.array([tok], dtype=np.int32), root))
            hedges.append(mine)
        logits, n = self._decode(items)
        st.predraft_tokens += n
        hedge_logits = iter(logits[len(jobs):])
        evals_left = []
        for job, slot, tree, (ids, probs), lg, mine in zip(jobs, slots, trees, tops, logits,
                                                            hedges):
            main = tree.branches[0]
            slot.tokens = np.append(slot.tokens, np.int32(main.tokens[0]))
            if policy.multi_sequence and self.n_extra:
                p2_ids, p2_probs = top_candidates(_tempered(lg, job.temperature), 1)
                first = branch_candidates(ids, probs, float(p2_probs[0]),
                                          policy.max_branches - len(mine))
            else:
                first = [main.tokens[0]]
            self._extend(main, lg, job.temperature)
            weights = [float(probs[list(ids).index(t)]) for t in first]
            alloc = split_budget(job.evals, weights, cap=policy.k,
                                 alpha=self.acceptance.alpha(slot.seq_id,
                                                             regime(job.temperature)))
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
            for br, evals in mine:
                self._extend(br, next(hedge_logits), job.temperature)
                tree.branches.append(br)
                left.append(evals - 1)
            evals_left.append(left)
        # 3. extend every branch greedily, all branches of all requests in one decode
        while True:
            items, owners = [], []
            for job, slot, tree, left in zip(jobs, slots, trees, evals_left):
                for j, br in enumerate(tree.branches):
                    if left[j] <= 0:
                        continue
                    pos = tree.root_of(br) + len(br.tokens) - 1
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


def _hint(hints: list[Hint | None] | None, row: int) -> Hint | None:
    """Row ``row``'s lookup hint, if the proposer sent one."""
    return hints[row] if hints is not None and row < len(hints) else None


def _tempered(logits: np.ndarray, temperature: float) -> np.ndarray:
    """The logits a request samples from: scaled by its temperature (greedy: as they are)."""
    return logits if temperature < 1e-5 else logits / np.float32(temperature)

