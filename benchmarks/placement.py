"""Who runs on which core while vLLM decodes a batch: ``python -m benchmarks.placement METHOD``.

Starts one engine of a ``benchmarks.run`` method (``plain`` for plain vLLM;
target on core 0 as there), sends each prompt alone once (batch-1 traffic,
as a server sees it), then times batch 16 (greedy, 128 tokens) ``--repeats``
times. For each batch it prints the threads of the machine that ran or waited
the longest: CPU seconds run, seconds runnable but waiting for a core
(``/proc/<pid>/task/<tid>/schedstat``), the core each was last on and its
affinity. The target's thread (``VLLM::Worker``) waiting is time the target
lost to something else on its core.
"""

from __future__ import annotations

import argparse
import glob
import os
import time


def snapshot() -> dict:
    """Every thread's (run ns, wait ns, name, process name, last CPU, affinity)."""
    out = {}
    for task in glob.glob("/proc/[0-9]*/task/[0-9]*"):
        try:
            run, wait, _ = map(int, open(task + "/schedstat").read().split())
            stat = open(task + "/stat").read()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            cpu = int(stat[stat.rindex(")") + 2:].split()[36])
            pid = task.split("/")[2]
            pname = open(f"/proc/{pid}/comm").read().strip()
            mask = tuple(sorted(os.sched_getaffinity(int(task.split("/")[-1]))))
            out[task] = (run, wait, name, pname, cpu, mask)
        except (OSError, ValueError, IndexError):
            pass
    return out


def busiest(before: dict, after: dict, n: int = 12) -> list[tuple]:
    rows = []
    for task, (run, wait, name, pname, cpu, mask) in after.items():
        r0, w0 = before.get(task, (0, 0))[:2]
        if run - r0 > 1e6 or wait - w0 > 1e6:
            rows.append(((run - r0) / 1e9, (wait - w0) / 1e9, pname, name, cpu, mask))
    return sorted(rows, reverse=True)[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("method", help="plain, or a method of benchmarks.run (duo-full, ...)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from benchmarks.run import method_spec
    from duo_vllm.models import prepare_default_target
    from tests.support.specbench import chat_prompts, load_specbench

    target = prepare_default_target()
    prompts = chat_prompts(AutoTokenizer.from_pretrained(target),
                           [p for _, p in load_specbench(per_task=2)])
    spec = None if args.method == "plain" else method_spec(args.method, target)
    llm = LLM(model=target, max_model_len=2048, seed=0, dtype="float32",
              speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=128)
    for prompt in prompts:
        llm.generate([prompt], params, use_tqdm=False)
    batch = [prompts[i % len(prompts)] for i in range(args.batch)]
    for rep in range(args.repeats):
        before, t0 = snapshot(), time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds, after = time.perf_counter() - t0, snapshot()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{args.method}, batch {args.batch}, repeat {rep}: {tokens / seconds:.1f} tok/s "
              f"in {seconds:.2f} s")
        print("| process/thread | run s | waiting s | last CPU | affinity |\n|---|---|---|---|---|")
        for run, wait, pname, name, cpu, mask in busiest(before, after):
            print(f"| {pname}/{name} | {run:.2f} | {wait:.2f} | {cpu} | {list(mask)} |")


if __name__ == "__main__":
    main()
