"""Run one vLLM engine in its own process and write what it generated as JSON.

    python -m tests.support.vllm_runner request.json result.json   (in the repository)

request.json: {"target", "prompts" (chat-formatted text), "max_tokens",
"temperature", "top_p", "speculative_config" (or null), "env" (extra
variables), "max_model_len", "max_num_seqs", "dtype" (default float32: the
default target's own dtype), "n", "seed" or "seeds" (one per prompt), "eager"
(vLLM's enforce_eager), "then_batched" (prompts generated all at once after the
others, in the same engine), "trace" (with then_batched: which of vLLM's step functions
each of those steps called, tests/support/step_trace.py)}. Keeping each engine in a process of its own
isolates the tests from vLLM's process and signal handling, and frees all of an
engine's memory and Ray processes when it exits.
"""

import json
import os
import sys


def main() -> int:
    with open(sys.argv[1]) as f:
        req = json.load(f)
    os.environ.update(req.get("env") or {})
    # lets draft_stats send a function to the worker (test-only, local engine)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams

    from duo_vllm.cli import draft_stats, spec_decode_metrics

    llm = LLM(model=req["target"], max_model_len=req.get("max_model_len", 2048), seed=0,
              dtype=req.get("dtype", "float32"), max_num_seqs=req.get("max_num_seqs", 256),
              speculative_config=req.get("speculative_config"), disable_log_stats=False,
              enforce_eager=req.get("eager", False))

    def sampling(seed):
        return SamplingParams(temperature=req.get("temperature", 0.0),
                              top_p=req.get("top_p", 1.0), max_tokens=req["max_tokens"],
                              n=req.get("n", 1), seed=seed)

    seeds = req.get("seeds")  # one seed per prompt, or one for all
    params = [sampling(s) for s in seeds] if seeds else sampling(req.get("seed"))
    if req.get("sequential"):  # one request at a time (batch 1), as a latency user would
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in req["prompts"]]
    else:
        outs = llm.generate(req["prompts"], params, use_tqdm=False)
    result = {}
    if req.get("then_batched"):  # prompts asked all at once afterwards, in the same engine
        result["draft_stats_before_batched"] = draft_stats(llm)
        if req.get("trace"):
            from tests.support import step_trace

            llm.llm_engine.collective_rpc(step_trace.install)
        then = llm.generate(req["then_batched"], params, use_tqdm=False)
        result["then_token_ids"] = [[list(c.token_ids) for c in o.outputs] for o in then]
        if req.get("trace"):
            result["then_trace"] = llm.llm_engine.collective_rpc(step_trace.collect)[0]
    result |= {
        "token_ids": [[list(c.token_ids) for c in o.outputs] for o in outs],
        "text": [[c.text for c in o.outputs] for o in outs],
        "metrics": spec_decode_metrics(llm),
    }
    if req.get("speculative_config"):
        result["draft_stats"] = draft_stats(llm)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
