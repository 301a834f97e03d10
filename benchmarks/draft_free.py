"""What vLLM's speculative step costs where no row has a draft, with and without
DuoProposer's draft-free sampling hook (patches/README.md, 2c).

One engine per call, target on cores 0-1: plain vLLM (``plain``), vLLM with a
proposer that drafts nothing (``spec``: ``benchmarks.oracle.EmptyProposer``), or the
same with the hook (``free``: ``DraftFreeEmptyProposer``). It times ``--rounds``
``generate()`` calls of one batch, ``ignore_eos`` so every round makes the same number
of tokens (sampled rounds compare too), after one untimed round.

    python -m benchmarks.draft_free spec --batch 16 --temperature 0 --rounds 3

Run the modes one after another, twice, and compare medians: engines differ by
several percent on a small VM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

PROPOSERS = {"plain": None, "spec": "benchmarks.oracle.EmptyProposer",
             "free": "benchmarks.oracle.DraftFreeEmptyProposer"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=sorted(PROPOSERS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--target", default=str(Path.home() / ".cache/duo_vllm/target"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from tests.support.specbench import chat_prompts, load_specbench

    model = PROPOSERS[args.mode]
    spec = None if model is None else {"model": model, "num_speculative_tokens": 4}
    prompts = chat_prompts(AutoTokenizer.from_pretrained(args.target),
                           [text for _, text in load_specbench(per_task=2)])
    prompts = [prompts[i % len(prompts)] for i in range(args.batch)]
    llm = LLM(model=args.target, max_model_len=2048, seed=0, dtype="float32",
              speculative_config=spec)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens,
                            ignore_eos=True, seed=1)
    llm.generate(prompts, params, use_tqdm=False)
    seconds = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t)
    print(json.dumps({"mode": args.mode, "batch": args.batch,
                      "temperature": args.temperature, "seconds": seconds,
                      "median_s": statistics.median(seconds)}))


if __name__ == "__main__":
    main()
