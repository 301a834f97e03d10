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

vLLM-CPU's oneDNN matmuls keep one primitive per input shape, and oneDNN splits
a primitive's work for the thread count of its first call: one first run while
the target drafted on fewer threads runs on those few after the cores are lent
back. :class:`MatmulPrimitives` empties those caches before a lent step that
would run such a shape.
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


def lend_prefill(target_tokens: int, draft_tokens: int, drafting: int, full: int) -> bool:
    """Should the target prefill new prompts on every core, the draft prefilling
    them only after, rather than the two prefilling side by side?

    Side by side, drafting starts when the target's prefill ends, after
    ``n·c_own`` (``n = target_tokens``, the prompt tokens it computes, those
    of its prefix cache aside; ``c_own`` its time a token on its ``drafting``
    threads). Lent, the prefill takes ``n·c_all`` with
    ``c_all = c_own·drafting/full`` (a CPU prefill scales with its threads);
    then the draft prefills ``draft_tokens`` (what it sees of the prompts: its
    window of each) at ``d`` a token while the target decodes without drafts.
    Lending starts drafting no later, and the first tokens sooner, when

        n·c_own·(1 - drafting/full) >= d·draft_tokens.

    Taking ``d = c_own`` (a draft no cheaper a token than the target: the
    default pair is one model at two precisions, measured 5.9-6.1 against
    5.3 ms a prompt token) this lends only where lending pays, and with a
    smaller draft sometimes not where it would.
    """
    if target_tokens <= 0 or full <= drafting:
        return False
    return target_tokens * (1 - drafting / full) >= draft_tokens


def remake_pays(prefill_tokens: int, per_token_s: float, drafting: int, full: int,
                remake_s: float) -> bool:
    """Remake the target's matmuls before a lent step that would reuse one made on fewer
    threads (:class:`MatmulPrimitives`)?

    A decode step's row count comes back step after step: yes. A step with
    ``prefill_tokens`` prompt tokens (a new prompt, a chunk of one) runs its row
    count once: on ``drafting`` threads it takes ``n·c`` (``c = per_token_s``, a
    token on those threads), on all ``full`` threads ``n·c·drafting/full``, so
    the remake (``remake_s``, measured) pays where ``n·c·(1 - drafting/full)``
    exceeds it: a prompt of a few hundred tokens does not repay 0.3-0.5 s.
    """
    if prefill_tokens <= 0:
        return True
    return prefill_tokens * per_token_s * (1 - drafting / full) > remake_s


class TargetThreads:
    """The target's OpenMP thread count, switched between steps in vLLM's worker
    thread (the one that runs the model). ``setter`` is ``torch``'s by default."""

    def __init__(self, plan: tuple[int, int], setter: Callable[[int], None] | None = None,
                 on_lend: Callable[[], None] | None = None):
        self.full, self.drafting = plan
        self.on_lend = on_lend  # after each switch to every thread, in the same thread
        if setter is None:
            import torch

            # vLLM-CPU replaces torch.set_num_threads with a warning (after its
            # binding); torch._C's is the original, for this thread's OpenMP team
            setter = torch._C.set_num_threads
        self._set = setter
        self.lent = True  # the target starts with every thread of its binding
        self.switches = 0
        self.lent_steps = 0

    def use(self, lend: bool) -> bool:
        """Before the next step: the target gets the draft's cores (``lend``) or not.
        Whether that switched the thread count."""
        switch = lend != self.lent
        if switch:
            self._set(self.full if lend else self.drafting)
            self.lent = lend
            self.switches += 1
            if lend and self.on_lend is not None:
                self.on_lend()
        self.lent_steps += lend
        return switch


# vLLM-CPU's oneDNN handlers: ``create_onednn_mm(weight, 32)`` in
# vllm/model_executor/layers/utils.py, an LRU of 32 primitives per weight shape
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
    """The layers vLLM-CPU runs through oneDNN's matmul handler, one per cache key a
    step makes (less its rows): ``(n, k, dtype, has a bias) -> (linear, k, dtype,
    the bias a step passes)``, the first layer of each."""
    found = {}
    for n, k, dtype, linear, layer in _onednn_layers(model):
        bias = _step_bias(layer)
        found.setdefault((n, k, dtype, bias is not None), (linear, k, dtype, bias))
    return found


def per_shape(keys: dict[tuple, tuple]) -> list[tuple]:
    """One ``(linear, k, dtype)`` per weight shape of :func:`onednn_keys`: the layers of
    one shape share one primitive cache."""
    found = {}
    for (n, k, dtype, _), (linear, *_) in keys.items():
        found.setdefault((n, k, dtype), (linear, k, dtype))
    return list(found.values())


def onednn_linears(model) -> list[tuple]:
    """One ``(linear, k, dtype)`` per weight shape among the layers that vLLM-CPU runs
    through oneDNN's matmul handler (``layer.cpu_linear`` calling ``onednn_mm``)."""
    return per_shape(onednn_keys(model))


def bias_variants(keys: dict[tuple, tuple]) -> int:
    """The most cache entries one step makes per row count in one shape's cache (its
    layers with a bias and without: 1 or 2), of :func:`onednn_keys`."""
    return max(Counter(key[:3] for key in keys).values(), default=1)


# the decode-sized row counts made for every thread up front (MatmulPrimitives.warm)
WARM_ROWS = ONEDNN_CACHE // 2


class MatmulPrimitives:
    """Empties vLLM-CPU's oneDNN primitive caches, so that the shapes a lent step
    runs are made anew, for every thread.

    A primitive made for one thread and run on two still runs on one: lent steps
    at batch 1 ran at one-core speed once the engine had drafted (0.80x plain
    vLLM, against 0.93x with the caches emptied). A primitive made for two runs
    at one-thread speed on one, so drafting steps need nothing.
    The caches key a shape by its rows, row stride and bias, not by threads;
    ``2 * capacity`` two-row inputs, each with a row stride no layer uses, evict
    every older entry (the first ``capacity`` are new each time: the last ones
    pushed them out the time before). Each makes a primitive anew: 0.3-0.4 s in
    all in vLLM's worker. So the caches are emptied only before a lent step that
    would reuse a primitive made on fewer threads (:meth:`before_step`), as an LRU
    model of the caches, keyed by the steps' token rows, tells: a wide batch lent
    after drafting at batch 1 runs row counts drafting never made, and a row count
    first run lent keeps its primitive for every thread through drafting steps.
    Not the int8 layers (``onednn_scaled_mm``: their cache keys no row stride).

    Every refresh, and the start, then makes the decode-sized shapes (1 to
    ``warm_rows`` token rows, as the target's steps pass them) on every thread
    (:meth:`warm`): a drafting step reuses them at one-thread speed, and a lent
    step after it finds them made for every thread, so the steps the draft
    leaves idle are lent without a refresh (one cost a batch-1 run three
    refreshes, ~1 s). With the step hook only: without it every lend refreshes.
    A step makes one entry per bias variant of a shape, so where layers of one
    shape differ in having a bias the caches hold half the row counts
    (``rows_held``), and half of those are made up front.
    """

    def __init__(self, model, capacity: int = ONEDNN_CACHE, warm_rows: int = WARM_ROWS):
        import torch

        self._torch = torch
        keys = onednn_keys(model)
        self.linears = per_shape(keys)
        self._warm = list(keys.values())  # the keys a step makes, bias or none
        self.capacity = capacity
        # the row counts the caches hold: a step makes one entry per bias variant
        self.rows_held = capacity // bias_variants(keys)
        # half of them made up front: room for the steps' other shapes
        self.warm_rows = min(warm_rows, self.rows_held // 2)
        self.refreshes = 0
        self.skipped = 0  # lent steps that ran a primitive made on fewer threads (not worth it)
        # the caches as the steps since the last refresh left them, an LRU like vLLM's:
        # token rows -> whether its primitive was made on every thread
        self.made: OrderedDict[int, bool] = OrderedDict()

    def needs_refresh(self, rows: int) -> bool:
        """Would a lent step of ``rows`` token rows reuse a primitive made on fewer
        threads?"""
        return self.made.get(rows) is False

    def before_step(self, rows: int, lent: bool, remake: bool = True) -> bool:
        """The target is about to run a step of ``rows`` token rows through its linear
        layers, on every thread (``lent``) or fewer. Empties the caches first where
        the step would reuse a primitive made on fewer threads (True), unless that
        does not pay (``remake`` False, :func:`remake_pays`): the step then runs it on
        fewer threads, and it stays marked as made on fewer."""
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
        """Empty the caches now, on every thread, and make the decode-sized shapes anew
        (counted in ``refreshes``). Called where the target runs on every thread."""
        self.evict()
        self.made.clear()
        self.refreshes += 1
        self.warm()

    def warm(self) -> None:
        """Make the primitives of 1 to ``warm_rows`` token rows now, on this thread's
        OpenMP threads: contiguous inputs with each layer's bias, the keys the
        target's steps will look up. Only right after :meth:`evict` (at the start and
        in :meth:`refresh`, on every thread): a row count still cached keeps the
        primitive it had. If a call fails, the warm-up stops for good (logged) and
        the eviction alone goes on."""
        torch = self._torch
        try:
            with torch.inference_mode():
                for rows in range(1, self.warm_rows + 1):  # within rows_held
                    for linear, k, dtype, bias in self._warm:
                        linear(torch.zeros(rows, k, dtype=dtype), None, bias)
                    self.made[rows] = True
        except Exception as e:  # vLLM's internals moved: lent steps remake as before
            logger.warning("DuoProposer: making the target's decode-sized oneDNN matmuls "
                           "for every thread failed (%s); no longer tried", e)
            self.warm_rows, self._warm = 0, []

    def evict(self) -> None:
        torch = self._torch
        with torch.inference_mode():
            for linear, k, dtype in self.linears:
                buf = torch.zeros(2 * (k + 2 * self.capacity), dtype=dtype)
                for s in range(1, 2 * self.capacity + 1):
                    linear(buf.as_strided((2, k), (k + s, 1)), None, None)
