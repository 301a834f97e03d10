"""Counters of the draft side, cumulative since start (read by logs, benchmarks, /metrics)."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, fields


class Ema:
    """Exponential moving average; ``None`` until the first sample."""

    def __init__(self, weight: float = 0.2):
        self.weight, self.value = weight, None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.weight * (x - self.value)

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


# the Counters' names in as_dict()
RENAMED = {"branch_hits": "branch_hits_by_rank", "misses": "predraft_misses",
           "branch_counts": "branch_count_distribution"}


@dataclass
class DraftStats:
    """Counters of the draft side, cumulative since start."""

    steps: int = 0
    requests: int = 0  # request-steps served
    predraft_hits: int = 0  # served from a branch, no waiting
    predraft_lookups: int = 0  # request-steps that had a branch tree to look in
    branch_hits: collections.Counter = field(default_factory=collections.Counter)  # by rank
    # request-steps without a hit, by branching.miss_reason ("unplanned": no pre-draft,
    # "cut": stopped before its tree), and "shallow": hits that served nothing
    misses: collections.Counter = field(default_factory=collections.Counter)
    branch_counts: collections.Counter = field(default_factory=collections.Counter)
    chosen_lengths: collections.Counter = field(default_factory=collections.Counter)
    returned_tokens: int = 0
    sync_tokens: int = 0  # evaluated while vLLM waited
    predraft_tokens: int = 0  # evaluated while vLLM verified
    prefill_tokens: int = 0
    reused_tokens: int = 0
    interrupted: int = 0
    skipped_busy: int = 0  # steps that went without a draft: the drafter was prefilling
    prefetched_prompts: int = 0  # prompts evaluated while the target prefilled them
    floor_steps: int = 0  # steps the controller chose plain decoding for every request
    no_slot: int = 0  # request-steps left to plain decoding: every draft slot was in use
    probes: int = 0  # drafts made only to re-measure acceptance
    short_lived: int = 0  # request-steps not pre-drafted: the request ends first
    lookup_predrafts: int = 0  # pre-drafts planned from the end of a served lookup draft
    lookup_misses: int = 0  # pre-draft misses served their lookup draft, no draft on the spot
    hedged_roots: int = 0  # pre-drafts rooted where a served lookup copy parts from the model
    deep_hits: int = 0  # hits on a branch the context follows for more than its first token
    # the prompt cache: slots restored from it, prefill tokens spared, failed restores
    cache_hits: int = 0
    cache_tokens: int = 0
    cache_failures: int = 0
    errors: int = 0
    busy_s: float = 0.0
    sync_s: float = 0.0  # drafting on the spot while vLLM waited
    sync_calls: int = 0  # steps that drafted on the spot
    started: float | None = None  # the first step

    def as_dict(self) -> dict:
        """Every counter (the Counters as sorted dicts, under their published names) and
        the rates derived from them."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, collections.Counter):
                out[RENAMED.get(f.name, f.name)] = dict(sorted(value.items()))
            elif f.name != "started":
                out[f.name] = value
        wall = time.monotonic() - self.started if self.started is not None else 0.0
        lookups = self.predraft_lookups
        out.update(
            predraft_hit_rate=self.predraft_hits / self.requests if self.requests else 0.0,
            branch_hit_rate=self.predraft_hits / lookups if lookups else 0.0,
            draft_tokens_per_step=self.returned_tokens / self.steps if self.steps else 0.0,
            floor_fraction=self.floor_steps / self.steps if self.steps else 0.0,
            busy_fraction=self.busy_s / wall if wall > 0 else 0.0)
        return out
