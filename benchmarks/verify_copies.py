"""vLLM's rejection sampler on one step with drafts, stock and without the logits
copies it keeps for logprobs (``duo_vllm.vllm.patches.install_logprob_free_verify``).

Hand-built logits (random), ``--k`` drafts a request, one thread on core 0, vLLM-CPU's
kernels as its platform registers them. Medians of ``--steps`` calls; the tokens of
both arms are checked equal.

    python -m benchmarks.verify_copies --batch 16 --vocab 49152 --k 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from duo_vllm.vllm.patches import (fix_cpu_expand_kernel, with_bonus_without_logprobs,
                                       with_logprob_free_verify)
    from tests.support.vllm_metadata import sampling_metadata, spec_metadata

    CpuPlatform.register_triton_kernel_overrides()
    fix_cpu_expand_kernel()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {0})
    drafts = [[5] * args.k for _ in range(args.batch)]
    meta = spec_metadata(drafts)
    logits = torch.randn(args.batch * (args.k + 1), args.vocab)
    temps = [args.temperature] * args.batch
    stock = (RejectionSampler.forward, Sampler.forward)
    arms = {"stock": stock,
            "no copies": (with_logprob_free_verify(stock[0]), with_bonus_without_logprobs(stock[1]))}
    for r in range(args.rounds):
        times, tokens = {}, {}
        for arm, (verify, sample) in arms.items():
            RejectionSampler.forward, Sampler.forward = verify, sample
            verifier, ts, out = RejectionSampler(Sampler()), [], []
            for i in range(args.steps):
                sm = sampling_metadata(temps, seed=i)
                x = logits.clone()
                t0 = time.perf_counter()
                out.append(verifier(meta, None, x, sm).sampled_token_ids.tolist())
                ts.append(time.perf_counter() - t0)
            times[arm], tokens[arm] = 1e3 * statistics.median(ts[5:]), out
        RejectionSampler.forward, Sampler.forward = stock
        print(f"round {r}: batch {args.batch}, vocab {args.vocab}, k {args.k}, temperature "
              f"{args.temperature:g}: stock {times['stock']:.2f} ms, without the copies "
              f"{times['no copies']:.2f} ms a step; same tokens: "
              f"{tokens['stock'] == tokens['no copies']}", flush=True)


if __name__ == "__main__":
    main()
