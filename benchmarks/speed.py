"""Batch-1 latency of DuoProposer against plain vLLM and vLLM's ngram, in one run.

    python -m benchmarks.speed [--per-task 2] [--max-tokens 128] [--methods ...]

Each method runs in a fresh engine (its own process), over the same
Spec-Bench prompts with the target's chat template, one request at a time,
greedy. The first request of each engine is a warm-up and is not counted.
Speedups are ratios against baselines measured in the same run; per-prompt
tokens/s are summarised by their median. Greedy outputs of every method are
checked against plain vLLM's.

Methods (core binding in brackets, on a 2-core machine):
  plain-1core   plain vLLM, target on core 0 (the same core DuoProposer's target gets)
  plain-all     plain vLLM on all cores (the fairest plain baseline on a CPU-only box)
  ngram         vLLM's ngram proposer, all cores
  duo-serial    DuoProposer, draft while vLLM waits (target core 0, draft core 1)
  duo-single    DuoProposer, parallel pre-drafting, one branch
  duo-full      DuoProposer, parallel + multi-sequence + auto budget
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

K = 4
METHODS = {
    "plain-1core": dict(bind="0", spec=None),
    "plain-all": dict(bind="0-1", spec=None),
    "ngram": dict(bind="0-1", spec={"method": "ngram", "num_speculative_tokens": K,
                                    "prompt_lookup_max": 4, "prompt_lookup_min": 2}),
    "duo-serial": dict(bind="0", duo={"parallel": False, "multi_sequence": False,
                                      "budget": K}),
    "duo-single": dict(bind="0", duo={"parallel": True, "multi_sequence": False,
                                      "budget": "auto"}),
    "duo-full": dict(bind="0", duo={"parallel": True, "multi_sequence": True,
                                    "budget": "auto"}),
}


def worker(req_path: str, out_path: str) -> None:
    req = json.loads(Path(req_path).read_text())
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # stats from the local worker
    from vllm import LLM, SamplingParams

    from duo_vllm.cli import spec_decode_metrics

    llm = LLM(model=req["target"], max_model_len=2048, seed=0, dtype=req["dtype"],
              speculative_config=req["spec"], disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"])
    llm.generate(req["prompts"][:1], params, use_tqdm=False)  # warm-up, not counted
    before = spec_decode_metrics(llm)
    rows = []
    for prompt in req["prompts"]:
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        rows.append({"tokens": len(out.outputs[0].token_ids), "seconds": dt,
                     "token_ids": list(out.outputs[0].token_ids)})
    after = spec_decode_metrics(llm)
    result = {"rows": rows, "spec": {k: after[k] - before[k]
                                     for k in ("drafts", "proposed", "accepted")}}
    if req["spec"] and req["spec"].get("model") == "duo_vllm.DuoProposer":
        try:
            result["draft_stats"] = llm.llm_engine.collective_rpc(
                lambda self: self.model_runner.drafter.stats())[0]
        except Exception as e:  # informative only
            result["draft_stats"] = {"error": repr(e)}
    Path(out_path).write_text(json.dumps(result))


def run_method(name: str, target: str, prompts: list[str], max_tokens: int,
               tmp: Path, dtype: str = "auto") -> dict:
    m = METHODS[name]
    spec = m.get("spec")
    if "duo" in m:
        from duo_vllm.cli import speculative_config

        spec = speculative_config(K, dict(m["duo"], draft_cores=[1]))
    req = tmp / f"{name}.json"
    req.write_text(json.dumps({"target": target, "prompts": prompts, "spec": spec,
                               "max_tokens": max_tokens, "dtype": dtype}))
    out = tmp / f"{name}.out.json"
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=m["bind"], VLLM_CPU_KVCACHE_SPACE="1")
    log = tmp / f"{name}.log"
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "benchmarks.speed", "--worker", str(req),
                             str(out)], env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{name} failed, see {log}:\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


def summarise(results: dict) -> str:
    def tps(r):
        return [row["tokens"] / row["seconds"] for row in r["rows"]]

    ref = results.get("plain-1core") or next(iter(results.values()))
    lines = ["| method | tok/s (median) | spread (min-max) | vs plain-1core | vs plain-all | "
             "vs ngram | mean accepted len | greedy = plain |",
             "|---|---|---|---|---|---|---|---|"]
    med = {n: statistics.median(tps(r)) for n, r in results.items()}
    for name, r in results.items():
        s = r["spec"]
        mal = f"{1 + s['accepted'] / s['drafts']:.2f}" if s.get("drafts") else "-"
        same = all(a["token_ids"] == b["token_ids"] for a, b in zip(r["rows"], ref["rows"]))

        def ratio(base):
            return f"{med[name] / med[base]:.2f}x" if base in med else "-"

        lines.append(f"| {name} | {med[name]:.1f} | {min(tps(r)):.1f}-{max(tps(r)):.1f} | "
                     f"{ratio('plain-1core')} | {ratio('plain-all')} | {ratio('ngram')} | "
                     f"{mal} | {'yes' if same else 'NO'} |")
    for name, r in results.items():
        if "draft_stats" in r:
            ds = r["draft_stats"]
            keys = ("predraft_hit_rate", "branch_hit_rate", "draft_tokens_per_step",
                    "branch_count_distribution", "busy_fraction", "draft_token_ms",
                    "target_step_ms", "acceptance_ema")
            lines.append(f"\n{name}: " + ", ".join(
                f"{k}={ds[k]:.3g}" if isinstance(ds.get(k), float) else f"{k}={ds.get(k)}"
                for k in keys))
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-task", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--out", help="write the JSON results here")
    ap.add_argument("--dtype", default="auto", help="target dtype (vLLM's --dtype)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from duo_vllm.models import prepare_default_target
    from duo_vllm.prompts import chat_prompts, load_specbench

    target = prepare_default_target()
    pairs = load_specbench(per_task=args.per_task)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(target), [p for _, p in pairs])
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.methods:
            t0 = time.time()
            results[name] = run_method(name, target, prompts, args.max_tokens, Path(tmp),
                                       args.dtype)
            print(f"[bench] {name}: done in {time.time() - t0:.0f}s", file=sys.stderr)
    table = summarise(results)
    print(f"\nmachine: {os.cpu_count()} cores; batch 1, greedy, {args.max_tokens} new tokens, "
          f"{len(prompts)} Spec-Bench prompts; default pair = SmolLM2-135M-Instruct at two "
          "precisions (Q4_1 draft, dequantised target)\n")
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
