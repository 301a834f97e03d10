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
