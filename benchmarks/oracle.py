"""The oracle proposer: replays plain vLLM's greedy output as the draft.

Its drafts are perfect for greedy requests and cost nothing (a list lookup in
the worker process, no model), so its speed is the ceiling no proposer can
beat on this machine with the same target and ``num_speculative_tokens``.
It belongs to the benchmarks, not the package.

    speculative_config={"model": "benchmarks.oracle.OracleProposer",
                        "num_speculative_tokens": 4}

with ``$DUO_ORACLE_FILE`` naming a JSON list of token-id sequences, each a
prompt followed by plain vLLM's greedy continuation of it.
"""

from __future__ import annotations

import json
import os

ENV_VAR = "DUO_ORACLE_FILE"


class OracleProposer:
    def __init__(self, vllm_config):
        path = os.environ.get(ENV_VAR)
        if not path:
            raise ValueError(f"OracleProposer needs ${ENV_VAR}: a JSON list of token sequences")
        with open(path) as f:
            self.references = [list(map(int, seq)) for seq in json.load(f)]
        self.k = vllm_config.speculative_config.num_speculative_tokens

    def lookup(self, context) -> list[int]:
        """The reference that ``context`` follows, continued for up to k tokens."""
        n = len(context)
        for ref in self.references:
            if len(ref) > n and ref[:n] == context:
                return ref[n:n + self.k]
        return []

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        out = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                out.append([])
                continue
            n = int(num_tokens_no_spec[i])
            out.append(self.lookup(token_ids_cpu[i, :n].tolist()))
        return out

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load."""


class EmptyProposer:
    """Proposes nothing, ever: vLLM's speculative step with no drafts.

    Its speed is the floor a proposer reaches when it turns drafting off
    (the ``spec-empty`` method of ``benchmarks/run.py``): plain decoding plus
    whatever vLLM's speculative path costs with empty drafts.
    """

    def __init__(self, vllm_config):
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load."""


class DraftFreeEmptyProposer(EmptyProposer):
    """:class:`EmptyProposer` with DuoProposer's draft-free sampling hook
    (``spec-free-all``): vLLM's speculative step with empty drafts, sampled as plain
    decoding (patches/README.md, 2c)."""

    def __init__(self, vllm_config):
        from duo_vllm.vllm.patches import install_draft_free_inputs

        if not install_draft_free_inputs():
            raise RuntimeError("this vLLM has no GPUModelRunner._prepare_inputs to hook")


class RayEmptyProposer(EmptyProposer):
    """:class:`EmptyProposer` in an engine that has started DuoProposer's private Ray
    instance (``spec-ray``): what Ray alone costs vLLM's loop."""

    def __init__(self, vllm_config):
        from duo_vllm.config import DuoConfig
        from duo_vllm.runtime.raynode import ensure_ray

        ensure_ray(DuoConfig())


class ActorEmptyProposer(EmptyProposer):
    """:class:`EmptyProposer` beside DuoProposer's draft actor, loaded and never called
    (``spec-actor``): what an idle draft actor on its own core costs vLLM's loop."""

    def __init__(self, vllm_config):
        from duo_vllm.runtime.actor import get_or_create_actor
        from duo_vllm.config import DuoConfig
        from duo_vllm.models import default_draft_gguf
        from duo_vllm.runtime.raynode import background_daemons, ensure_ray

        cfg = DuoConfig(draft_cores=(1,))
        ray = ensure_ray(cfg)
        self.actor = get_or_create_actor(cfg, default_draft_gguf(), [1], 4)
        background_daemons(keep=ray.get(self.actor.info.remote())["pid"])  # as DuoProposer


class ActorFreeEmptyProposer(ActorEmptyProposer, DraftFreeEmptyProposer):
    """:class:`ActorEmptyProposer` with DuoProposer's draft-free sampling hook
    (``spec-actor-free-all``): the floor of a lent step without DuoProposer's own
    per-step work (lookups, gates, thread lending)."""

    def __init__(self, vllm_config):
        ActorEmptyProposer.__init__(self, vllm_config)
        DraftFreeEmptyProposer.__init__(self, vllm_config)


class CycleProposer(EmptyProposer):
    """Drafts of a set size in a fixed cycle of steps, to measure T(B, e), the target's
    step time by batch size and verified draft tokens (``spec-cycle``; a probe).

    Step i gives each of the first ``m`` rows ``n`` draft tokens (token 0: wrong, so all
    but the first are rejected and the next step is again one token per row), for (m, n)
    in ``CYCLE`` by turn. Every call appends ``[seconds since the last call, rows, e
    of the last call]`` to ``$DUO_PROBE_FILE`` as a JSON line.
    """

    CYCLE = ((0, 0), (1, 1), (16, 1), (4, 4), (16, 2), (0, 0), (16, 4), (2, 2))

    def __init__(self, vllm_config):
        self.path = os.environ.get("DUO_PROBE_FILE")
        self.i, self.last, self.e = 0, None, 0

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        import time

        now = time.perf_counter()
        rows = sum(1 for s in sampled_token_ids if len(s))
        if self.path and self.last is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps([now - self.last, rows, self.e]) + "\n")
        m, n = self.CYCLE[self.i % len(self.CYCLE)]
        self.i += 1
        out = [[0] * n if j < m and len(s) else [] for j, s in enumerate(sampled_token_ids)]
        self.e = sum(len(d) for d in out)
        self.last = time.perf_counter()
        return out
