"""CPU time per process and thread while one engine runs batches of 16 (a probe).

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 \\
        python -m benchmarks.cpu_time duo-lend --out cpu.json

Starts one engine of a ``benchmarks.run`` method, decodes 4 prompts one by
one (batch 1, where DuoProposer drafts), then runs 3 static batches of 16
greedy requests, and for each batch diffs every thread's user+system time in
/proc (Linux): which process took the CPU the target's OpenMP threads needed.
Prints tokens/s per batch; writes the top processes and threads to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict


def snapshot(proc: str = "/proc") -> dict:
    """(pid, tid) -> (process name, thread name, CPU ticks, CPU it last ran on)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir(proc)):
        try:
            with open(f"{proc}/{pid}/comm") as f:
                pname = f.read().strip()
            for tid in os.listdir(f"{proc}/{pid}/task"):
                with open(f"{proc}/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
                rest = stat[stat.rindex(")") + 2:].split()
                tname = stat[stat.index("(") + 1:stat.rindex(")")]
                out[(int(pid), int(tid))] = (pname, tname, int(rest[11]) + int(rest[12]),
                                             int(rest[36]))
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
    return out


def cpu_seconds(before: dict, after: dict) -> list[list]:
    """[seconds, pid, process, thread, last CPU] of every thread that ran, most first."""
    tick = os.sysconf("SC_CLK_TCK")
    rows = [[(v[2] - before.get(k, (0, 0, 0))[2]) / tick, k[0], v[0], v[1], v[3]]
            for k, v in after.items()]
    return sorted((r for r in rows if r[0] > 0), reverse=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("method", help="a benchmarks.run method, e.g. duo-lend or spec-empty-all")
    ap.add_argument("--out", default="cpu_time.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from duo_vllm.models import default_draft_gguf, prepare_default_target
    from tests.support.specbench import chat_prompts

    from .run import load_prompts, method_spec

    target, draft = prepare_default_target(), default_draft_gguf()
    pairs = load_prompts(argparse.Namespace(per_task=2, jsonl=None))
    prompts = chat_prompts(AutoTokenizer.from_pretrained(target), [p for _, p in pairs])
    llm = LLM(model=target, max_model_len=2048, seed=0, dtype="float32",
              speculative_config=method_spec(args.method, target, draft, 4, 8))
    params = SamplingParams(temperature=0.0, max_tokens=128)
    for p in prompts[:4]:
        llm.generate([p], params, use_tqdm=False)
    batch = [prompts[i % len(prompts)] for i in range(16)]
    out = []
    for rep in range(3):
        before, t0 = snapshot(), time.perf_counter()
        outs = llm.generate(batch, [params] * len(batch), use_tqdm=False)
        seconds, rows = time.perf_counter() - t0, cpu_seconds(before, snapshot())
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        procs = defaultdict(float)
        for s, pid, pname, *_ in rows:
            procs[(pid, pname)] += s
        out.append({"rep": rep, "seconds": seconds, "tokens": tokens,
                    "tok_s": tokens / seconds,
                    "procs": sorted(([s, pid, n] for (pid, n), s in procs.items()),
                                    reverse=True)[:12],
                    "threads": rows[:20]})
        print(f"batch {rep}: {tokens / seconds:.1f} tok/s", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
