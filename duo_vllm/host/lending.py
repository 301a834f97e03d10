"""Lending the draft's cores to a CPU target while drafting does not pay.

vLLM-CPU binds the target's OpenMP thread ``i`` to the ``i``-th core of its binding
list. When the draft's cores are the tail of that list the two time-share them:
while the gate drafts, the target runs fewer threads (the head of the list); while
plain decoding is faster, or the draft side is held or gone, it runs one thread per
core as plain vLLM would. :func:`lend_plan` decides whether that is possible;
:class:`TargetThreads` switches ``torch.set_num_threads`` between steps.

oneDNN splits a matmul primitive's work for the thread count of its first call, so
:class:`MatmulPrimitives` empties vLLM-CPU's primitive caches before a lent step
that would reuse one made on fewer threads.
"""
from __future__ import annotations

import inspect
import logging
import re
from collections import Counter, OrderedDict
from typing import Callable

from duo_vllm.host.cores import parse_cpu_list

logger = logging.getLogger(__name__)


def bind_order(environ) -> list[int] | None:
    """The target's cores in OpenMP thread order (``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY``,
    ``OMP_PLACES``, vLLM's binding); ``None``: unknown or unbound."""
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
    """``(threads lent, threads while drafting)``, or ``None`` when the draft's cores
    cannot be lent: they must be exactly the tail of ``order``, one thread per core,
    with at least one core before them."""
    if not order or not draft or threads != len(order) or len(set(order)) != len(order):
        return None
    keep = len(order) - len(draft)
    if keep < 1 or sorted(order[keep:]) != sorted(draft):
        return None
    return len(order), keep


# Of the draft's prefill time, the share a request loses when the draft prefills after the
# target's prefill rather than beside it: meanwhile it decodes without drafts, at about
# half the rate drafting gives (a 2x speedup); the draft's cost a token is taken as the
# target's, which errs towards not lending. 1.0 counts the whole prefill as lost.
PREFILL_LOSS = 0.5


def lend_prefill(target_tokens: int, draft_tokens: int, drafting: int, full: int,
                 loss: float = PREFILL_LOSS) -> bool:
    """Should the target prefill new prompts on every core, the draft prefilling after,
    rather than the two side by side?

    Lending saves ``n·c·(1 - drafting/full)`` on the first token and every token after
    it (``n = target_tokens``, a CPU prefill scaling with its threads); the request
    then decodes without drafts while the draft prefills ``draft_tokens``, losing
    ``loss`` of that time. It pays when ``n·(1 - drafting/full) >= loss·draft_tokens``.
    """
    if target_tokens <= 0 or full <= drafting:
        return False
    return target_tokens * (1 - drafting / full) >= loss * draft_tokens


def remake_pays(prefill_tokens: int, per_token_s: float, drafting: int, full: int,
                remake_s: float) -> bool:
    """Remake the target's matmuls before a lent step that would reuse one made on fewer
    threads (:class:`MatmulPrimitives`)?

    Always for a decode step (its row count recurs). A prefill of ``n`` tokens runs
    its row count once: the remake pays where the time it saves,
    ``n·per_token_s·(1 - drafting/full)``, exceeds ``remake_s``.
    """
    if prefill_tokens <= 0:
        return True
    return prefill_tokens * per_token_s * (1 - drafting / full) > remake_s


class TargetThreads:
    """The target's OpenMP thread count, switched between steps in vLLM's worker thread
    (``setter``: torch's by default)."""

    def __init__(self, plan: tuple[int, int], setter: Callable[[int], None] | None = None,
                 on_lend: Callable[[], None] | None = None):
        self.full, self.drafting = plan
        self.on_lend = on_lend  # after each switch to every thread, in the same thread
        if setter is None:
            import torch

            # vLLM-CPU replaces torch.set_num_threads with a warning; torch._C's is the original
            setter = torch._C.set_num_threads
        self._set = setter
        self.lent = True  # the target starts with every thread of its binding
        self.switches = 0
        self.lent_steps = 0

    def use(self, lend: bool) -> bool:
        """Before the next step, lend the target the draft's cores or not; True if switched."""
        switch = lend != self.lent
        if switch:
            self._set(self.full if lend else self.drafting)
            self.lent = lend
            self.switches += 1
            if lend and self.on_lend is not None:
                self.on_lend()
        self.lent_steps += lend
        return switch


# vLLM-CPU's ``create_onednn_mm(weight, 32)``: an LRU of 32 primitives per weight shape
ONEDNN_CACHE = 32


def _onednn_layers(model):
    """``(n, k, dtype, linear, layer)`` for each layer that vLLM-CPU runs through
    oneDNN's matmul handler (``layer.cpu_linear`` calling ``onednn_mm``)."""
    for layer in model.modules():
        linear = getattr(layer, "cpu_linear", None)
        code = getattr(linear, "__code__", None)
        if code is None or "onednn_mm" not in code.co_names:
            continue
        handler = inspect.getclosurevars(linear).nonlocals.get("handler")
        weight = getattr(layer, "weight", None)
        k, n = getattr(handler, "k", None), getattr(handler, "n", None)
        if k is None or n is None or weight is None:
            continue
        yield n, k, weight.dtype, linear, layer


def _step_bias(layer):
    """The bias a step passes the layer's matmul (vLLM's linear layers: none where
    the caller adds it)."""
    bias = getattr(layer, "bias", None)
    if not hasattr(bias, "shape") or getattr(layer, "skip_bias_add", False):
        return None
    return bias


def onednn_keys(model) -> dict[tuple, tuple]:
    """``(n, k, dtype, has a bias) -> (linear, k, dtype, bias)``: the first oneDNN layer
    of each cache key a step makes, rows aside."""
    found = {}
    for n, k, dtype, linear, layer in _onednn_layers(model):
        bias = _step_bias(layer)
        found.setdefault((n, k, dtype, bias is not None), (linear, k, dtype, bias))
    return found


def per_shape(keys: dict[tuple, tuple]) -> list[tuple]:
    """One ``(linear, k, dtype)`` per weight shape of :func:`onednn_keys` (one cache each)."""
    found = {}
    for (n, k, dtype, _), (linear, *_) in keys.items():
        found.setdefault((n, k, dtype), (linear, k, dtype))
    return list(found.values())


def onednn_linears(model) -> list[tuple]:
    """One ``(linear, k, dtype)`` per weight shape of the model's oneDNN layers."""
    return per_shape(onednn_keys(model))


def bias_variants(keys: dict[tuple, tuple]) -> int:
    """Cache entries a step makes per row count in one shape's cache: 1, or 2 where its
    layers differ in having a bias."""
    return max(Counter(key[:3] for key in keys).values(), default=1)


class MatmulPrimitives:
    """Keeps a lent step from running a oneDNN primitive made for fewer threads.

    A primitive runs on the thread count of its first call, so one made while drafting
    stays slow once the cores are lent back (the reverse costs nothing). The caches key
    a shape by rows, row stride and bias, not threads: ``2 * capacity`` inputs with
    unused strides evict every entry, which is costly, so an LRU model of the caches
    (keyed by token rows) tells :meth:`before_step` when a lent step needs it. Where
    one shape's layers differ in having a bias, the caches hold half the row counts
    (``rows_held``).
    The int8 layers (``onednn_scaled_mm``) key no row stride and are left alone.
    """

    def __init__(self, model, capacity: int = ONEDNN_CACHE):
        import torch

        self._torch = torch
        keys = onednn_keys(model)
        self.linears = per_shape(keys)
        self.capacity = capacity
        self.rows_held = capacity // bias_variants(keys)  # row counts the caches hold
        self.refreshes = 0
        self.skipped = 0  # lent steps that ran a primitive made on fewer threads (not worth it)
        # an LRU model of the caches: token rows -> made on every thread
        self.made: OrderedDict[int, bool] = OrderedDict()

    def needs_refresh(self, rows: int) -> bool:
        """Would a lent step of ``rows`` token rows reuse a primitive made on fewer threads?"""
        return self.made.get(rows) is False

    def before_step(self, rows: int, lent: bool, remake: bool = True) -> bool:
        """Before a step of ``rows`` token rows on every thread (``lent``) or fewer: empty
        the caches if it would reuse a primitive made on fewer threads and ``remake``
        (:func:`remake_pays`) allows; True if it did."""
        refresh = lent and self.needs_refresh(rows)
        if refresh and not remake:
            self.skipped += 1
            refresh = False
        if refresh:
            self.refresh()
        if rows in self.made:  # a hit keeps the primitive, whatever the threads now
            self.made.move_to_end(rows)
        else:
            self.made[rows] = lent
            while len(self.made) > self.rows_held:
                self.made.popitem(last=False)
        return refresh

    def refresh(self) -> None:
        """Empty the caches; call on every thread."""
        self.evict()
        self.made.clear()
        self.refreshes += 1

    def evict(self) -> None:
        torch = self._torch
        with torch.inference_mode():
            for linear, k, dtype in self.linears:
                buf = torch.zeros(2 * (k + 2 * self.capacity), dtype=dtype)
                for s in range(1, 2 * self.capacity + 1):
                    linear(buf.as_strided((2, k), (k + s, 1)), None, None)
