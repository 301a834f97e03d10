"""Lending the draft's cores to a CPU target while drafting does not pay (whether a lend
pays: :mod:`duo_vllm.control.lending`). vLLM-CPU binds the target's OpenMP thread ``i`` to
the ``i``-th core of its binding list: where the draft's cores are its tail
(:func:`lend_plan`), :class:`TargetThreads` switches the target's thread count between
steps, and :class:`MatmulPrimitives` keeps oneDNN primitives made on fewer threads out of
lent steps."""
from __future__ import annotations

import inspect
import re
from collections import Counter, OrderedDict
from typing import Callable

from duo_vllm.host.cores import parse_cpu_list


def bind_order(environ) -> list[int] | None:
    """The target's cores in OpenMP thread order (``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY``,
    ``OMP_PLACES``, vLLM's binding); ``None``: unknown or unbound."""
    gomp = environ.get("GOMP_CPU_AFFINITY", "").strip()
    kmp = re.search(r"proclist=\[([0-9,\- ]+)\]", environ.get("KMP_AFFINITY", ""))
    places = environ.get("OMP_PLACES", "").strip()
    bind = environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    try:
        if gomp:
            return [c for part in gomp.replace(",", " ").split() for c in parse_cpu_list(part)]
        if kmp:
            return [c for part in kmp.group(1).split(",") for c in parse_cpu_list(part)]
        if places.startswith("{"):  # one core per place, thread i on place i; else unordered
            cores = [parse_cpu_list(p) for p in places.replace("},", "}|").split("|")]
            return [c[0] for c in cores] if all(len(c) == 1 for c in cores) else None
        if bind and bind not in ("auto", "nobind", "all") and "|" not in bind:
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


def onednn_keys(model) -> dict[tuple, Callable]:
    """``(n, k, dtype, has a bias) -> linear``: the first layer of each cache key a step makes
    (rows aside), of those vLLM-CPU runs through oneDNN's matmul handler (``layer.cpu_linear``
    calling ``onednn_mm``)."""
    found = {}
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
        bias = getattr(layer, "bias", None)  # passed to the matmul unless the caller adds it
        has_bias = hasattr(bias, "shape") and not getattr(layer, "skip_bias_add", False)
        found.setdefault((n, k, weight.dtype, has_bias), linear)
    return found


class MatmulPrimitives:
    """Keeps a lent step from running a oneDNN primitive made for fewer threads (a primitive
    runs on the thread count of its first call). The caches key a shape by rows, row stride
    and bias, not threads, and evicting every entry (``2 * capacity`` inputs of unused
    strides) is costly, so an LRU model of the caches (by token rows) tells
    :meth:`before_step` when a lent step needs it. The int8 layers (``onednn_scaled_mm``)
    key no stride: left alone."""

    def __init__(self, model, capacity: int = ONEDNN_CACHE):
        keys = onednn_keys(model)
        shapes: dict[tuple, tuple] = {}  # one (linear, k, dtype) per weight shape: a cache each
        for (n, k, dtype, _), linear in keys.items():
            shapes.setdefault((n, k, dtype), (linear, k, dtype))
        self.linears = list(shapes.values())
        self.capacity = capacity
        # row counts the caches hold: half where a shape's layers differ in having a bias
        self.rows_held = capacity // max(Counter(key[:3] for key in keys).values(), default=1)
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
        (:func:`~duo_vllm.control.lending.remake_pays`) allows; True if it did."""
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
        import torch

        with torch.inference_mode():
            for linear, k, dtype in self.linears:
                buf = torch.zeros(2 * (k + 2 * self.capacity), dtype=dtype)
                for s in range(1, 2 * self.capacity + 1):
                    linear(buf.as_strided((2, k), (k + s, 1)), None, None)
