"""What one lookup costs: :func:`duo_vllm.sources.lookup.find_continuation` by context length.

    python -m benchmarks.lookup_cost [--lengths 1024 4096 16384] [--repeats 200]

The proposer runs the n-gram matcher on every row of every step, in vLLM's
loop, so its cost is on the step's critical path. Each context is random
tokens of a 50k vocabulary with its last 6 tokens copied from near the start
(the match is found at the far end of the search); the median and the worst of
``--repeats`` calls are printed per length. tests/test_lookup.py checks what it
finds at 16k tokens; this says how long that takes (the test asserted under
50 ms before, about 0.1 ms measured on the dev VM).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from duo_vllm.sources.lookup import find_continuation


def time_lookup(length: int, repeats: int, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    c = rng.integers(0, 50000, length).astype(np.int32)
    c[-6:] = c[100:106]
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        found = find_continuation(c, 8, 2, 8)
        out.append(time.perf_counter() - t0)
    assert found.tolist() == c[106:114].tolist()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    print(f"{'tokens':>8} {'median ms':>10} {'max ms':>8}")
    for n in args.lengths:
        t = time_lookup(n, args.repeats)
        print(f"{n:>8} {1e3 * statistics.median(t):>10.3f} {1e3 * max(t):>8.3f}")


if __name__ == "__main__":
    main()
