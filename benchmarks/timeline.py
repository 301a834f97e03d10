"""Where a batch shape's time goes, step by step: ``python -m benchmarks.timeline RESULTS``.

Reads a ``results.json`` of ``benchmarks.run --timeline`` (each static-batch
row keeps its steps: seconds, unfinished requests before the step, tokens it
produced) and prints, per method, shape and repeat, the steps grouped by how
many requests were still running: steps, seconds, ms a step and tokens/s.
The first groups hold the prefill step(s); the last, the tail of requests
that finish late.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def phases(steps) -> dict[int, list]:
    """Steps grouped by running requests (16+, 8-15, 4-7, 2-3, 1): [steps, s, tokens]."""
    out: dict[int, list] = defaultdict(lambda: [0, 0.0, 0])
    for seconds, live, tokens in steps:
        group = 1 << (max(1, min(live, 16)).bit_length() - 1)
        out[group][0] += 1
        out[group][1] += seconds
        out[group][2] += tokens
    return dict(sorted(out.items(), reverse=True))


def main(argv=None) -> int:
    path = (argv or sys.argv[1:] or ["benchmarks/results/run/results.json"])[0]
    results = json.load(open(path))["results"]
    for method, r in results.items():
        for shape in r.get("shapes", []):
            for row in shape["rows"]:
                if not row.get("steps"):
                    continue
                total = sum(s[0] for s in row["steps"])
                print(f"{method}, batch {shape['batch']} at {shape['temperature']}, repeat "
                      f"{row['repeat']}: {total:.2f} s, {len(row['steps'])} steps")
                for group, (n, s, tok) in phases(row["steps"]).items():
                    print(f"  {group:>2}+ running: {n:4d} steps {s:6.2f} s "
                          f"{1e3 * s / n:6.1f} ms/step {tok / s if s else 0:6.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
