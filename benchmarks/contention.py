"""Does work on the draft's core slow the target's core? (A probe, no vLLM.)

On core 0, a target-like workload: fp32 matrix-vector products over ~700 MB
of weights (a decode step of a memory-bound model) and matrix-matrix
products (a prefill). On core 1, in turn: nothing, a compute-bound loop
(a 256x256 matmul that fits in cache), and a memory-streaming loop (sums
over 384 MB). If the compute loop slows core 0, the two cores share a
physical core (SMT siblings); if only the streaming loop does, they share
memory bandwidth, and the draft's own decode calls (which stream the draft's
weights) cost the target time.

    python -m benchmarks.contention
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np


def _busy(kind: str, core: int) -> None:
    os.sched_setaffinity(0, {core})
    if kind == "compute":
        a = np.random.rand(256, 256).astype(np.float32)
        while True:
            a @ a
    big = [np.random.rand(16 * 1024 * 1024).astype(np.float32) for _ in range(6)]
    while True:
        for v in big:
            v.sum()


def _target(core: int, seconds: float) -> tuple[float, float]:
    import torch

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {core})
    weights = [torch.randn(576, 1536) for _ in range(200)]
    x, prompt = torch.randn(1, 576), torch.randn(512, 576)

    def timed(fn, secs):
        fn()
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < secs:
            fn()
            n += 1
        return 1e3 * (time.perf_counter() - t0) / n

    decode = timed(lambda: [x @ w for w in weights], seconds)
    prefill = timed(lambda: [prompt @ w for w in weights[:50]], seconds)
    return decode, prefill


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for kind in ("idle", "compute", "memory"):
        proc = None
        if kind != "idle":
            proc = mp.get_context("spawn").Process(target=_busy, args=(kind, 1), daemon=True)
            proc.start()
            time.sleep(2)
        try:
            rows.append((kind, *_target(0, 5.0)))
        finally:
            if proc is not None:
                proc.kill()
                proc.join()
    base = rows[0]
    print("| core 1 | decode-like step ms | vs idle | prefill-like ms | vs idle |")
    print("|---|---|---|---|---|")
    for kind, d, p in rows:
        print(f"| {kind} | {d:.1f} | {d / base[1]:.2f}x | {p:.1f} | {p / base[2]:.2f}x |")


if __name__ == "__main__":
    main()
