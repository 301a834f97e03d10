"""Which of vLLM's step functions each engine step calls: the trace that shows a step
without drafts runs plain vLLM's code (tests/test_e2e_vllm.py).

:func:`install` and :func:`collect` run in vLLM's worker (``collective_rpc``); a step
starts at each ``_prepare_inputs`` call (``step:drafts`` where the scheduler sent drafts to
verify, else ``step:none``), which also records whether vLLM prepared it
for plain decoding (``inputs:plain``: no spec-decode metadata) or for verification.
"""

from __future__ import annotations

import functools
import importlib

# (module, class, method) -> the event a call records
TRACED = {
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_calc_spec_decode_metadata"):
        "spec_metadata",
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "propose_draft_token_ids"):
        "propose",
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "take_draft_token_ids"):
        "take_drafts",
    ("vllm.v1.sample.sampler", "Sampler", "forward"): "sampler",
    ("vllm.v1.sample.rejection_sampler", "RejectionSampler", "forward"): "rejection_sampler",
}
PREPARE = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs")
# the proposer's own calls: what a speculative engine adds to a step by design
PROPOSER_CALLS = ("propose", "take_drafts")

EVENTS: list[str] = []
_ORIGINALS: dict = {}


def _recording(fn, name):
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        EVENTS.append(name)
        return fn(*args, **kwargs)
    return traced


def _preparing(fn):
    @functools.wraps(fn)
    def traced(self, scheduler_output, *args, **kwargs):
        drafts = bool(getattr(scheduler_output, "scheduled_spec_decode_tokens", None))
        EVENTS.append(f"step:{'drafts' if drafts else 'none'}")  # drafts to verify?
        out = fn(self, scheduler_output, *args, **kwargs)
        meta = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        EVENTS.append("inputs:plain" if meta is None else "inputs:spec")
        return out
    return traced


def install(worker=None) -> bool:
    """Wrap the traced methods (over any hook already installed)."""
    EVENTS.clear()
    for (module, cls_name, method), name in [*TRACED.items(), (PREPARE, None)]:
        cls = getattr(importlib.import_module(module), cls_name)
        fn = getattr(cls, method)
        _ORIGINALS[(cls, method)] = fn
        setattr(cls, method, _preparing(fn) if name is None else _recording(fn, name))
    return True


def collect(worker=None) -> list[str]:
    """The events since :func:`install`; the methods unwrapped."""
    for (cls, method), fn in _ORIGINALS.items():
        setattr(cls, method, fn)
    _ORIGINALS.clear()
    return list(EVENTS)


def steps(events: list[str], drafts: bool | None = None,
          skip=PROPOSER_CALLS) -> list[tuple[str, ...]]:
    """The events of each step (only those with drafts to verify, or only those without:
    ``drafts``), without the proposer's own calls."""
    out: list[tuple[bool, list[str]]] = []
    for event in events:
        if event.startswith("step:"):
            out.append((event == "step:drafts", []))
        elif out and event not in skip:
            out[-1][1].append(event)
    return [tuple(e) for d, e in out if drafts is None or d == drafts]
