"""The target's step time T(B, e) by batch size B and verified draft tokens e.

    DUO_PROBE_FILE=/tmp/cycle.jsonl python -m benchmarks.run --methods spec-cycle \\
        --batch-sizes 16 --temperatures --sampled-batch-sizes --staggered 0
    python -m benchmarks.step_cost /tmp/cycle.jsonl

``spec-cycle`` (``benchmarks/oracle.py``: ``CycleProposer``) drafts a fixed
cycle of draft sizes, every draft rejected, and logs each step's seconds with
its batch size and draft tokens; this prints the median per (B, e) (seen twice or
more) and, per B, the slope through those medians: what one more verified token
costs.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def table(rows) -> dict[int, dict[int, list[float]]]:
    by: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for seconds, batch, extra in rows:
        by[batch][extra].append(seconds)
    return by


def slope(points: dict[int, list[float]]) -> float | None:
    """Least-squares slope through the median step of each e seen at least twice (a
    median, so a prefill or the pause between two batches in the log does not count)."""
    meds = {e: statistics.median(v) for e, v in points.items() if len(v) >= 2}
    if len(meds) < 2:
        return None
    mx, my = statistics.fmean(meds), statistics.fmean(meds.values())
    return (sum((x - mx) * (y - my) for x, y in meds.items())
            / sum((x - mx) ** 2 for x in meds))


def main(argv=None) -> int:
    path = (argv or sys.argv[1:])[0]
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print("| B | e | steps | median ms | slope ms/token (this B) |\n|---|---|---|---|---|")
    for batch, points in sorted(table(rows).items()):
        if sum(map(len, points.values())) < 10:
            continue  # a few steps on the way down to a smaller batch
        c = slope(points)
        for e, v in sorted(points.items()):
            if len(v) < 2:
                continue
            print(f"| {batch} | {e} | {len(v)} | {1e3 * statistics.median(v):.1f} | "
                  f"{'-' if c is None else f'{1e3 * c:.1f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
