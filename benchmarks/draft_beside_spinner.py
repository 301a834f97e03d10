"""The draft's width-1 call on core 1: alone, beside a process that loops on
``sched_yield`` on that core (as vLLM's engine core waits for its worker's
step output, pinned to the draft's core while the draft drafts), and beside
a pure busy loop there (the reference of a process that takes half the core).

    python -m benchmarks.draft_beside_spinner [--core 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import numpy as np


def spin(core: int, mode: str, stop) -> None:
    os.sched_setaffinity(0, {core})
    while not stop.is_set():
        if mode == "yield":
            os.sched_yield()


def call_ms(be, prompt: np.ndarray, calls: int = 60) -> float:
    """Median ms of a width-1 decode call after ``prompt`` (one position, re-used)."""
    ctx, times = len(prompt), []
    for r in range(calls):
        t0 = time.perf_counter()
        be.decode([(0, np.array([int(prompt[r % ctx])], dtype=np.int32), ctx)])
        times.append(time.perf_counter() - t0)
        be.remove(0, ctx, -1)
    return 1e3 * statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    from duo_vllm.runtime.actor import pin_process
    from duo_vllm.draft.backend import LlamaCppBackend
    from duo_vllm.models import default_draft_gguf, prepare_draft

    pin_process([args.core])
    be = LlamaCppBackend(prepare_draft(default_draft_gguf(), "auto"), n_ctx=1024, n_seq=1,
                         n_threads=1)
    prompt = np.random.default_rng(0).integers(100, be.n_vocab - 100, size=256).astype(np.int32)
    be.decode([(0, prompt, 0)])
    res: dict = {}
    for _ in range(args.rounds):
        for mode in ("alone", "yield", "busy"):
            stop, p = mp.Event(), None
            if mode != "alone":
                p = mp.Process(target=spin, args=(args.core, mode, stop))
                p.start()
                time.sleep(0.2)
            res.setdefault(mode, []).append(call_ms(be, prompt))
            if p is not None:
                stop.set()
                p.join()
    for mode, ms in res.items():
        print(f"{mode}: width-1 call ms {', '.join(f'{x:.1f}' for x in ms)}")


if __name__ == "__main__":
    main()
