"""Arms side by side: plain vLLM and DuoProposer's arms, alternated round by round.

    python -m benchmarks.ab --batch 4 --rounds 5 --per-task 4 --arms on off
    python -m benchmarks.ab --batch 1 --rounds 5 --per-round 4 --per-task 4 --arms on

This VM's speed drifts by 10-30% between runs of the same code, more than the
levers measured here. So both engines are loaded in one process, plain vLLM
and DuoProposer (duo-full's config; target on core 0, draft on core 1), and
each round runs the same prompts under every arm in turn, the order reversed
every other round. Each arm's speed is reported as the median over rounds of
its ratio to plain vLLM *in the same round*: drift cancels out of the pair.

Arms that are engines of their own: ``spec-empty``, ``spec-ray`` and
``spec-actor`` of ``benchmarks/run.py`` (vLLM's speculative step with empty
drafts; the same after DuoProposer's ``ray.init``; and beside an idle draft
actor), to find what DuoProposer costs when it drafts nothing.

Arms of the DuoProposer engine (applied through ``collective_rpc``; each arm
keeps a verdict of its own, so one arm's verdicts do not steer another's):

    on        DuoProposer as shipped
    off       drafting held off (``DuoProposer.hold``): vLLM's speculative step with
              empty drafts, the draft actor idle; what DuoProposer costs when it drafts
              nothing
    nolookup  no lookup drafts
    reach0    the verdict: every batch-size bucket above batch 1 starts without the model
    reach1    the verdict: a win carries one bucket up (shipped: two)

One DuoProposer arm besides ``off`` per run: the draft side keeps what it
evaluated of a prompt, so a second drafting arm would find the round's prompts
already prefilled. No prefix caching in either engine, for the same reason.
Between rounds the engines idle 1.5 s (vLLM's engine core spins for a second
after each step). Greedy output is compared with plain vLLM's, prompt by prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# arms that are engines of their own (benchmarks/run.py's methods), target on core 0
ENGINES = ("spec-empty", "spec-ray", "spec-actor")
ARMS = {
    "on": {},
    "off": {"hold": True},
    "nolookup": {"lookup": False},
    "reach0": {"verdict": {"reach": 0}},
    "reach1": {"verdict": {"reach": 1}},
}


def _setter(name: str, settings: dict):
    """A function for ``collective_rpc``: put the duo engine's proposer in arm ``name``."""

    def apply(worker):
        from duo_vllm.control.verdict import Verdict

        p = worker.model_runner.drafter
        ab = p.__dict__.setdefault("_ab", {"lookup": p.sources, "verdicts": {}})
        if name not in ab["verdicts"]:
            ab["verdicts"][name] = Verdict(p.verdict.modes, **settings.get("verdict", {}))
        p.verdict = ab["verdicts"][name]
        p.sources = ab["lookup"] if settings.get("lookup", True) else None
        p.hold(settings.get("hold", False))
        return True

    return apply


def rounds(args) -> dict:
    os.environ.update(VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_KVCACHE_SPACE="2",
                      VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from duo_vllm.models import default_draft_gguf, prepare_default_target
    from tests.support.specbench import chat_prompts

    from .run import load_prompts, method_spec

    target = prepare_default_target()
    pairs = load_prompts(args)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(target), [p for _, p in pairs])
    # no prefix cache: the arms of the duo engine run the same prompts in turn
    common = dict(model=target, max_model_len=2048, seed=0, dtype="float32",
                  enforce_eager=args.eager, enable_prefix_caching=False)
    engines = {"plain": LLM(**common)}
    for arm in args.arms:
        if arm in ENGINES:
            engines[arm] = LLM(**common, speculative_config=method_spec(arm, target,
                                                                        k=args.k))
    duo = None
    if any(arm in ARMS for arm in args.arms):
        duo = LLM(**common, speculative_config=method_spec(
            "duo-full", target, default_draft_gguf(), args.k, args.lookup_k))
    # sampled requests run to max_tokens (ignore_eos), as in run.py: tok/s, not sample length
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            ignore_eos=args.temperature > 0)
    for llm in [*engines.values(), duo]:  # warm-up, not counted
        if llm is not None:
            llm.generate(prompts[:1], params, use_tqdm=False)

    def run(llm, batch_prompts):
        t0 = time.perf_counter()
        if args.batch == 1:
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in batch_prompts]
        else:
            outs = llm.generate(batch_prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        ids = [list(o.outputs[0].token_ids) for o in outs]
        return {"tokens": sum(map(len, ids)), "seconds": dt, "token_ids": ids}

    arms = ["plain"] + list(args.arms)
    n = args.per_round if args.batch == 1 else args.batch
    if args.rounds * n > len(prompts):  # the draft side keeps what it saw of a prompt
        print(f"note: {args.rounds * n} prompts wanted, {len(prompts)} loaded: later rounds "
              "repeat prompts (more --per-task avoids it)", file=sys.stderr)
    log = []
    for r in range(args.rounds):
        batch_prompts = [prompts[(r * n + i) % len(prompts)] for i in range(n)]
        order = arms if r % 2 == 0 else arms[::-1]
        row = {}
        for arm in order:
            if duo is not None:  # the draft side idle unless the arm is DuoProposer's
                duo.llm_engine.collective_rpc(_setter(arm, ARMS[arm]) if arm in ARMS
                                              else _setter("off", ARMS["off"]))
            row[arm] = run(duo if arm in ARMS else engines[arm], batch_prompts)
            time.sleep(1.5)
        log.append(row)
        print(f"round {r}: " + ", ".join(f"{a} {row[a]['tokens'] / row[a]['seconds']:.1f} tok/s"
                                         for a in arms), file=sys.stderr)
    return {"arms": arms, "rounds": log}


def summarise(res: dict, greedy: bool) -> list[dict]:
    out = []
    for arm in res["arms"]:
        rates = [row[arm]["tokens"] / row[arm]["seconds"] for row in res["rounds"]]
        ratios = [(row[arm]["tokens"] / row[arm]["seconds"])
                  / (row["plain"]["tokens"] / row["plain"]["seconds"]) for row in res["rounds"]]
        same = all(row[arm]["token_ids"] == row["plain"]["token_ids"] for row in res["rounds"])
        out.append({"arm": arm, "tok_s": statistics.median(rates),
                    "vs_plain": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios),
                    "greedy_equal": same if greedy else None})
    return out


def markdown(summary: list[dict], meta: dict) -> str:
    lines = [f"Machine: {meta['cpu']}, {meta['cores']} cores; target on core 0, draft on core 1. "
             "The default pair is one model at two precisions (SmolLM2-135M-Instruct: Q4_1 "
             f"GGUF draft, float32 target). Batch {meta['batch']}, temperature "
             f"{meta['temperature']}, {meta['max_tokens']} new tokens, {meta['rounds']} "
             "rounds, arms alternated within each round (both engines in one process).", "",
             "| arm | tok/s (median) | vs plain, same round (median) | min-max | greedy = plain |",
             "|---|---|---|---|---|"]
    for s in summary:
        eq = "-" if s["greedy_equal"] is None else ("yes" if s["greedy_equal"] else "**no**")
        lines.append(f"| {s['arm']} | {s['tok_s']:.1f} | {s['vs_plain']:.2f}x | "
                     f"{s['lo']:.2f}-{s['hi']:.2f}x | {eq} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=["on", "off"], choices=[*ENGINES, *ARMS])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--per-round", type=int, default=4, help="batch 1: prompts per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--per-task", type=int, default=2)
    ap.add_argument("--jsonl", nargs="*")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lookup-k", type=int, default=8)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/ab")
    args = ap.parse_args(argv)
    from .run import machine_info

    res = rounds(args)
    greedy = args.temperature == 0.0
    summary = summarise(res, greedy)
    info = machine_info()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = info["cpu_model"] + (" with AVX-512" if " avx512f" in flags else " without AVX-512")
    meta = {"cpu": cpu, "cores": info["cores"],
            "machine": info, "batch": args.batch, "temperature": args.temperature,
            "max_tokens": args.max_tokens, "rounds": args.rounds, "arms": res["arms"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for row in res["rounds"]:
        for arm in row.values():
            arm.pop("token_ids", None)
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                  "rounds": res["rounds"]}, indent=1))
    table = markdown(summary, meta)
    (out / "results.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
