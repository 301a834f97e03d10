"""What one step's Ray call to the draft actor costs: full contexts against deltas.

    python -m benchmarks.ray_step_bytes [--context 16384] [--batch-sizes 1 4 16] [--steps 300]

A real Ray instance, started as DuoProposer starts it (a private local
instance, 128 MiB object store), and two stand-in draft actors made as
get_or_create_actor makes the real one (``num_cpus=0, max_concurrency=1``),
with no model: one takes full contexts (before), the other deltas against
the contexts it keeps (after, duo_vllm/runtime/delta.py); both turn them into the
drafter's ``np.int32`` contexts and return empty drafts. Every step the
batch's contexts (``--context`` tokens to begin with, vLLM-style request
ids) grow by 1-4 tokens, and both actors are called with them, in turn,
alternating which goes first: the same steps, the same run. Per step:
the bytes pickled (the contexts argument, protocol 5, as Ray pickles it)
and the proposer's wait for ``propose.remote`` + ``ray.get``, the sender's
encoding included; also the actor's own decode time. Writes
``results.json`` and ``results.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import subprocess
import time

import numpy as np

from duo_vllm.runtime.delta import Delta, DeltaReceiver, DeltaSender, Drafts
from duo_vllm.runtime.message import StepRequest


class StandInActor:
    """The draft actor's propose() without the drafter: decode, return empty drafts."""

    def __init__(self):
        self.receiver = DeltaReceiver()
        self.decode_s: list[float] = []

    def propose(self, step: StepRequest):
        t0 = time.perf_counter()
        contexts = step.contexts
        if isinstance(contexts, Delta):
            full, resend = self.receiver.decode(contexts)
        else:
            full, resend = [np.asarray(c, dtype=np.int32) for c in contexts], None
        self.decode_s.append(time.perf_counter() - t0)
        assert all(c is not None for c in full)
        drafts = [[] for _ in full]
        return Drafts(drafts, resend) if resend else drafts

    def lengths(self) -> list[int]:
        return sorted(h.n for h in self.receiver._held.values())

    def decode_ms(self, skip: int) -> float:
        return 1e3 * statistics.median(self.decode_s[skip:])


def start_ray():
    import logging

    import ray

    ray.init(address="local", object_store_memory=128 * 1024 * 1024,
             _node_ip_address="127.0.0.1", include_dashboard=False,
             logging_level=logging.WARNING, namespace="duo_bench_ray_step")
    return ray


def run_batch(ray, batch: int, context: int, steps: int, warmup: int, seed: int) -> dict:
    cls = ray.remote(num_cpus=0, max_concurrency=1)(StandInActor)
    full_actor, delta_actor = cls.remote(), cls.remote()
    rng = np.random.default_rng(seed)
    keys = [f"cmpl-{rng.integers(1 << 62):032x}-0" for _ in range(batch)]
    table = [rng.integers(0, 49152, context).astype(np.int32) for _ in range(batch)]
    sender = DeltaSender()
    out = {"full": {"bytes": [], "ms": []}, "delta": {"bytes": [], "ms": []}}
    budgets = [4] * batch

    def call(mode, contexts):
        t0 = time.perf_counter()
        if mode == "full":
            payload, actor = contexts, full_actor
        else:
            payload, actor = sender.encode(keys, contexts), delta_actor
        drafts = ray.get(actor.propose.remote(StepRequest(payload, budgets, 0.05)))
        ms = 1e3 * (time.perf_counter() - t0)
        assert len(drafts) == batch and not getattr(drafts, "resend", [])
        return payload, ms

    for i in range(warmup + steps):
        table = [np.concatenate([t, rng.integers(0, 49152, rng.integers(1, 5))]).astype(np.int32)
                 for t in table]
        contexts = [t.copy() for t in table]  # the proposer's copies of vLLM's token table
        for mode in (("full", "delta") if i % 2 else ("delta", "full")):
            payload, ms = call(mode, contexts)
            if i >= warmup:
                out[mode]["bytes"].append(len(pickle.dumps(payload, protocol=5)))
                out[mode]["ms"].append(ms)
    assert ray.get(delta_actor.lengths.remote()) == sorted(len(t) for t in table)
    result = {"batch": batch, "context_start": context, "context_end": max(len(t) for t in table),
              "steps": steps}
    for mode, actor in (("full", full_actor), ("delta", delta_actor)):
        b, ms = out[mode]["bytes"], sorted(out[mode]["ms"])
        result[mode] = {
            "bytes_median": int(statistics.median(b)), "bytes_max": max(b),
            "ms_median": statistics.median(ms), "ms_p90": ms[int(0.9 * (len(ms) - 1))],
            "actor_decode_ms_median": ray.get(actor.decode_ms.remote(warmup)),
        }
    for actor in (full_actor, delta_actor):
        ray.kill(actor)
    return result


def machine() -> dict:
    model = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    import ray

    return {"cpu": model, "cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "numpy": np.__version__, "ray": ray.__version__}


def markdown(results: list[dict], info: dict) -> str:
    lines = [f"Ray step call, full contexts vs deltas ({info['cpu']}, {info['cpus']} CPUs, "
             f"Ray {info['ray']}); contexts from {results[0]['context_start']} tokens, "
             f"+1-4 per step, {results[0]['steps']} steps; medians.", "",
             "| batch | bytes/step full | bytes/step delta | ms/call full | ms/call delta "
             "| actor decode ms full | actor decode ms delta |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        f, d = r["full"], r["delta"]
        lines.append(f"| {r['batch']} | {f['bytes_median']:,} | {d['bytes_median']:,} "
                     f"| {f['ms_median']:.2f} | {d['ms_median']:.2f} "
                     f"| {f['actor_decode_ms_median']:.3f} | {d['actor_decode_ms_median']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "ray-step"))
    args = ap.parse_args(argv)
    ray = start_ray()
    try:
        info = machine()
        results = []
        for b in args.batch_sizes:
            results.append(run_batch(ray, b, args.context, args.steps, args.warmup, args.seed))
            print(json.dumps(results[-1]), flush=True)
    finally:
        ray.shutdown()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"machine": info, "args": vars(args), "results": results}, f, indent=1)
    md = markdown(results, info)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
