"""Lending the draft's cores to a CPU target while drafting does not pay.

On vLLM-CPU the target's OpenMP threads are bound one per core, thread ``i``
to the ``i``-th core of the binding list (libgomp's ``GOMP_CPU_AFFINITY``,
Intel OpenMP's ``KMP_AFFINITY`` proclist, ``OMP_PLACES``). When the draft's
cores are the tail of that list, the two can time-share them:

- while the gate drafts, the target runs on the head of the list only (fewer
  OpenMP threads), and the draft has its cores to itself;
- while the gate measures plain decoding faster (a wide batch, sampled
  requests the draft rarely guesses), or the draft side is held or gone, the
  target runs one thread per core of the whole list, as plain vLLM would.

The switch is ``torch.set_num_threads`` from vLLM's worker thread, between two
steps: the threads beyond the count idle, bound to their cores as before. Only
the decision is here (:func:`lend_plan`); :class:`TargetThreads` applies it.
"""
from __future__ import annotations

import re
from typing import Callable

from .host import parse_cpu_list


def bind_order(environ) -> list[int] | None:
    """The target's cores in OpenMP thread order, as vLLM's CPU worker binds them
    (``None``: unknown, or no binding). Thread ``i`` runs on the ``i``-th."""
    gomp = environ.get("GOMP_CPU_AFFINITY", "").strip()
    if gomp:
        try:
            return [c for part in gomp.replace(",", " ").split() for c in parse_cpu_list(part)]
        except ValueError:
            return None
    kmp = re.search(r"proclist=\[([0-9,\- ]+)\]", environ.get("KMP_AFFINITY", ""))
    if kmp:
        try:
            return [c for part in kmp.group(1).split(",") for c in parse_cpu_list(part)]
        except ValueError:
            return None
    places = environ.get("OMP_PLACES", "").strip()
    if places.startswith("{"):  # one core per place, thread i on place i; else unordered
        try:
            cores = [parse_cpu_list(p) for p in places.replace("},", "}|").split("|")]
        except ValueError:
            return None
        return [c[0] for c in cores] if all(len(c) == 1 for c in cores) else None
    bind = environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if bind and bind not in ("auto", "nobind", "all") and "|" not in bind:
        try:
            return parse_cpu_list(bind)
        except ValueError:
            return None
    return None


def lend_plan(order: list[int] | None, draft: list[int] | None,
              threads: int) -> tuple[int, int] | None:
    """``(threads with the cores lent, threads while drafting)``, or ``None`` when
    the draft's cores cannot be lent to the target.

    They can when the target runs ``threads`` OpenMP threads, one per core of
    ``order``, and ``draft`` is exactly the tail of ``order`` with at least one
    core left before it: dropping the last threads frees the draft's cores.
    """
    if not order or not draft or threads != len(order) or len(set(order)) != len(order):
        return None
    keep = len(order) - len(draft)
    if keep < 1 or sorted(order[keep:]) != sorted(draft):
        return None
    return len(order), keep


class TargetThreads:
    """The target's OpenMP thread count, switched between steps in vLLM's worker
    thread (the one that runs the model). ``setter`` is ``torch``'s by default."""

    def __init__(self, plan: tuple[int, int], setter: Callable[[int], None] | None = None):
        self.full, self.drafting = plan
        if setter is None:
            import torch

            # vLLM-CPU replaces torch.set_num_threads with a warning (after its
            # binding); torch._C's is the original, for this thread's OpenMP team
            setter = torch._C.set_num_threads
        self._set = setter
        self.lent = True  # the target starts with every thread of its binding
        self.switches = 0
        self.lent_steps = 0

    def use(self, lend: bool) -> None:
        """Before the next step: the target gets the draft's cores (``lend``) or not."""
        if lend != self.lent:
            self._set(self.full if lend else self.drafting)
            self.lent = lend
            self.switches += 1
        self.lent_steps += lend
