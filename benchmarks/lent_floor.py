"""Lent steps against plain vLLM on the same cores, in one process.

    python -m benchmarks.lent_floor [--rounds 2] [--max-tokens 64] [--batch 1]

Two engines bound to cores 0-1: plain vLLM, and duo-lend (DuoProposer, the
target lending core 1 to the draft). Each round runs the same short prompts
(qa, math, translation; greedy, ``--batch`` at a time) four ways, one after the other:
duo-lend drafting; duo-lend held (``DuoProposer.hold``: no draft work, every
step on both cores, vLLM's speculative step with empty drafts); held again
after the target's oneDNN primitives were emptied (``MatmulPrimitives.refresh``:
every matmul made anew for both threads); plain vLLM. Held against plain is
what a step with the draft model off costs beside plain vLLM on the same
cores; the refresh tells whether primitives made on one thread explain it.
Prints tokens/s per way and round.
"""

from __future__ import annotations

import argparse
import os
import time

WAYS = ("drafting", "held", "held+refresh", "plain")


def _set(action: str):
    """A function for ``collective_rpc``: hold the duo engine's proposer, let it draft,
    or empty its target's oneDNN primitive caches."""

    def apply(worker):
        p = worker.model_runner.drafter
        if action == "refresh":
            p._primitives.refresh()
        else:
            p.hold(action == "hold")
        return p._threads.lent if p._threads else None

    return apply


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--per-task", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="prompts per generate() call")
    args = ap.parse_args(argv)
    os.environ.update(VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="2",
                      VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from duo_vllm.models import prepare_default_target
    from tests.support.specbench import chat_prompts, load_specbench

    from .run import method_spec

    target = prepare_default_target()
    pairs = load_specbench(args.per_task, tasks=("qa", "math_reasoning", "translation"))
    prompts = chat_prompts(AutoTokenizer.from_pretrained(target), [p for _, p in pairs])
    common = dict(model=target, max_model_len=2048, seed=0, dtype="float32",
                  enable_prefix_caching=False)
    plain = LLM(**common)
    duo = LLM(**common, speculative_config=method_spec("duo-lend", target))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in (plain, duo):  # warm-up, not counted
        llm.generate(prompts[:1], params, use_tqdm=False)

    def run(llm) -> float:
        tokens = seconds = 0.0
        for i in range(0, len(prompts), args.batch):
            t0 = time.perf_counter()
            outs = llm.generate(prompts[i:i + args.batch], params, use_tqdm=False)
            seconds += time.perf_counter() - t0
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens / seconds

    res: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(args.rounds):
        duo.llm_engine.collective_rpc(_set("draft"))
        res["drafting"].append(run(duo))
        duo.llm_engine.collective_rpc(_set("hold"))
        res["held"].append(run(duo))
        duo.llm_engine.collective_rpc(_set("refresh"))
        res["held+refresh"].append(run(duo))
        res["plain"].append(run(plain))
        print(f"round {r}: " + ", ".join(f"{w} {res[w][-1]:.1f}" for w in WAYS), flush=True)
    print("tok/s " + ", ".join(f"{w} {[round(x, 1) for x in res[w]]}" for w in WAYS))


if __name__ == "__main__":
    main()
