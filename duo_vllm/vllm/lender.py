"""DuoProposer's side of lending the draft's cores to a CPU target
(:mod:`duo_vllm.host.lending`): which steps lend them, a lent prompt handed to the draft
after its step, and the target's oneDNN matmuls remade for the thread count a step runs
on. :class:`CoreLending` is mixed into DuoProposer and reads its ``_threads`` (``None``:
the target lends nothing) and ``_primitives``."""

from __future__ import annotations

import time

from duo_vllm.control.lending import remake_pays
from duo_vllm.host.lending import MatmulPrimitives
from duo_vllm.logs import vllm_logger

logger = vllm_logger("duo_vllm.vllm.proposer")
# a remake of the target's matmuls until one is measured, and each measurement's weight
REMAKE_S, REMAKE_WEIGHT = 0.4, 0.3
# a prompt token on the target's own threads until its step time is measured
PREFILL_TOKEN_S = 0.0015
# the most a lend waits for the draft's decode call under way to end
PAUSE_WAIT_S = 0.25


class CoreLending:
    """The lending half of DuoProposer (module docstring)."""

    def _free_cores(self, idle: bool, drafts, partial: bool) -> bool:
        """Lend the draft's cores for this step? Only where the draft side is ``idle``,
        the step holds no partial prefill, and no remake of the matmuls is due."""
        if not idle or partial:
            return False
        if self._primitives is None or not self._remaking:
            return True
        if not self._hooked:  # remade at each lend: only from a lent step on
            return self._threads.lent
        rows = len(drafts) + sum(len(d) for d in drafts)  # the step's token rows
        return not self._primitives.needs_refresh(rows)

    def _lend(self, lend: bool) -> None:
        """The next step runs the target on the draft's cores too (``lend``), or not."""
        if self._threads is not None:
            self._threads.use(lend)

    def _prefill_lent(self) -> None:
        """The step runs on the draft's cores too, the draft's background work dropped."""
        if self._threads is not None and not self._threads.lent:
            self._pause_draft()
            self._lend(True)

    def _hand_off(self, lent: set, keys, contexts) -> bool:
        """Was every row of this step just prefilled on every core (``lent``: a lending
        target's new prompts)? Then their contexts go to the draft one-way, to prefill in
        the background, and the step does not wait for drafts: the first token comes at
        plain vLLM's time. The draft drafts for them from the next step."""
        if not lent or not all(key in lent for key in keys):
            return False
        self._prefetch_prompts(contexts)
        return True

    def _pause_draft(self) -> None:
        """The draft side drops its background work; a target about to take its cores
        first waits a bounded while for the decode call under way (sharing a core is slow)."""
        if self._client is None and self._worker is None:
            return  # lookups only: no draft side
        wait = self._threads is not None and self._threads.lent is False
        try:
            if self._client is not None:
                self._client.pause(PAUSE_WAIT_S if wait else 0.0)
            else:
                self._worker.pause(wait)
        except Exception as e:  # the next propose() finds out whether the side is gone
            logger.debug("DuoProposer: pause failed (%s: %s)", type(e).__name__, e)

    def load_model(self, model=None, *args, **kwargs) -> None:
        """vLLM's hook with the target model: a lending target's oneDNN matmuls, to be
        remade before a lent step that would reuse one made on fewer threads."""
        if self._threads is None or model is None or not hasattr(model, "modules"):
            return
        try:
            primitives = MatmulPrimitives(model)
            if primitives.linears and onednn_acl():
                # oneDNN on Arm's ACL re-packs the weights for each new input layout
                logger.info("DuoProposer: vLLM's oneDNN runs on Arm's ACL: its matmuls are "
                            "not remade at a lend")
                return
            primitives.evict()  # oneDNN's first build of the evicting shapes: at start-up
        except Exception as e:  # vLLM's internals moved: lent steps may run slower
            logger.warning("DuoProposer: cannot reach the target's oneDNN matmuls (%s); "
                           "steps on lent cores may not use them", e)
            return
        if primitives.linears:
            self._primitives, self._remaking = primitives, True
            if not self._hooked:  # no step hook: at each lend
                self._threads.on_lend = self._remake_primitives
            logger.info("DuoProposer: the target's oneDNN matmuls (%d weight shapes) are "
                        "remade for every thread %s", len(primitives.linears),
                        "before a lent step that would reuse one made on fewer threads"
                        if self._hooked else "at each lend")

    def before_step(self, tokens: int, prefill: int = 0) -> None:
        """vLLM is about to run a step of ``tokens`` token rows, ``prefill`` of them prompt
        tokens: a lending target's matmuls are remade first where due and it pays."""
        if self._primitives is not None and self._threads is not None and self._remaking:
            self._remake_primitives(tokens, prefill)

    def _remake_pays(self, prefill: int) -> bool:
        """Would remaking the matmuls before a lent step of ``prefill`` prompt tokens pay?"""
        per_token = self.step_time.per_token()  # a token on the target's own threads
        return remake_pays(prefill, PREFILL_TOKEN_S if per_token is None else per_token,
                           self._threads.drafting, self._threads.full, self._remake_s)

    def _remake_primitives(self, tokens: int | None = None, prefill: int = 0) -> None:
        t0 = time.perf_counter()
        try:
            if tokens is None:
                self._primitives.refresh()
            elif not self._primitives.before_step(
                    tokens, self._threads.lent, prefill <= 0 or self._remake_pays(prefill)):
                return
            self._remake_s += REMAKE_WEIGHT * (time.perf_counter() - t0 - self._remake_s)
        except Exception as e:  # never the step's failure: lent steps may be slower
            self._threads.on_lend, self._remaking = None, False
            logger.warning("DuoProposer: remaking the target's oneDNN matmuls failed (%s); "
                           "no longer tried", e)
        if self._started_at is not None:  # not the next step's time, for the gates
            self._started_at += time.perf_counter() - t0


def onednn_acl() -> bool:
    """Does vLLM run its oneDNN matmuls on Arm's Compute Library?"""
    from vllm import _custom_ops

    return bool(getattr(_custom_ops, "is_onednn_acl_supported", lambda: False)())
