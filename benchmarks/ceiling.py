"""Batch-1 greedy ceiling of DuoProposer on a cost table, replayed on stored outputs.

    python -m benchmarks.ceiling [--results DIR ...] [--t1 0.136 --tl 0.099 --c 0.008 --d 0.040]
        [--window 256] [--busy-prefill] [--best-of-lookups]

Reads plain vLLM's greedy outputs (``token_ids``, ``prompt_ids``) from
``DIR/engines/plain-*.out.json`` of a ``benchmarks.run`` output folder (default: every
folder under ``benchmarks/results/``), runs the draft GGUF once
over each prompt and output (teacher-forced: the draft's greedy guess at every
position, whole context) and replays decoding step by step, with no timing
noise. Each step takes the better (tokens per second) of:

- a *lent* step: the target on every core (``--tl`` a step), the lookup
  draft (:func:`duo_vllm.sources.lookup.find_continuation`, cut by
  :func:`duo_vllm.control.serving.paying_length` at α 0.74) verified at ``--c`` a token;
- a *drafting* step: the target on its own cores (``--t1``), the draft
  model's chain of ``n`` tokens (``(n + 1)·d <= t1 + c·n``: what it drafts
  during one step, its guess of the target's next token included; less
  ``--overhead-calls``) or the lookup draft, whichever is accepted further.

Four ways the model's chain is ready: ``oracle`` (every step), ``designed``
(the pre-draft's rule: the step before accepted its whole draft and the
draft's top-1 guessed the target's next token; otherwise a lent step),
``spot`` (the same, a miss drafting 1-4 tokens on the spot while vLLM waits)
and ``hedged`` (``designed``, and also wherever the target's token is among
the draft's top ``--hedge-width`` there, as if hedges on them cost no draft
time: a bound on any hedging of that width).
The draft prefills each prompt (``--prefill-draft`` s a token; with
``--window W`` only the part a W-token window holds, and its guesses see only
that part) beside the target's own prefill (``--prefill-target``); until it is
done, lookup steps, lent (or, with ``--busy-prefill``, on the target's own
cores, since the draft's core is prefilling). ``lookups``: no draft model at
all, every step lent; ``--best-of-lookups`` gives each request the faster of a
rule and that, as a perfect per-request gate would.
Prints each task's median of plain-on-every-core time over this time.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import numpy as np

from duo_vllm.control.serving import common_prefix, paying_length
from duo_vllm.sources.lookup import find_continuation


def stored_outputs(dirs) -> list[tuple[str, list[int], list[int]]]:
    """(task, prompt ids, greedy output ids) of every distinct prompt in the results."""
    seen: dict = {}
    for d in dirs:
        for f in sorted(glob.glob(os.path.join(d, "engines", "plain-*.out.json"))):
            for shape in json.load(open(f)).get("shapes", []):
                if shape.get("temperature", 0) != 0:
                    continue
                for row in shape["rows"]:
                    ids = list(zip(row.get("prompt_ids") or (), row.get("token_ids") or ()))
                    for p, o in ids:  # a batch's row names no task: a batch-1 row's does
                        task = row.get("task") if len(ids) == 1 else None
                        if seen.get(tuple(p), (None,))[0] is None:
                            seen[tuple(p)] = (task, list(p), list(o))
    return [(task or "other", p, o) for task, p, o in seen.values()]


def window_prompt(p: list[int], window: int) -> list[int]:
    """The part of a prompt a draft window of ``window`` tokens holds (0: all of it): its
    first quarter and its last tokens, as the drafter's slots do; the output follows."""
    if not window or len(p) <= window:
        return p
    head = window // 4
    return p[:head] + p[len(p) - (window - head):]


def draft_guesses(model_path: str, rows, window: int = 0,
                  rank: int = 1) -> list[list[int]] | tuple[list[list[int]], list]:
    """The draft's greedy token for each output position, given the true output and the
    prompt as a ``window`` holds it (0: the whole prompt). ``rank`` above 1: also its
    next ``rank - 1`` choices at each position (a tuple of the two lists)."""
    from llama_cpp import Llama

    llm = Llama(model_path, n_ctx=4096, logits_all=True, n_threads=os.cpu_count(),
                n_batch=512, verbose=False)
    out, second = [], []
    for _, p, o in rows:
        q = window_prompt(p, window)
        llm.reset()
        llm.eval(q + o)
        scores = np.asarray(llm.scores[len(q) - 1:len(q) + len(o) - 1])
        top = np.argsort(-scores, axis=-1, kind="stable")[:, :max(rank, 1)]
        out.append(top[:, 0].tolist())
        second.append([set(r) for r in top[:, 1:].tolist()])
    return (out, second) if rank > 1 else out


def replay(p, o, guess, t1, tl, c, d, prefill_target, prefill_draft, ready_rule, k=8,
           overhead_calls=0, window=0, busy_prefill=False, second=None):
    """(plain on every core, this) seconds for one request. ``overhead_calls``: draft
    calls of each pre-draft that add no token to the next step's chain. ``window``: the
    draft prefills that much of the prompt (0: all of it). ``busy_prefill``: while the
    draft prefills, its core is not the target's, so the lookup steps before it is ready
    run on the target's own cores (``t1``) rather than lent (``tl``). ``ready_rule``
    ``"lookups"``: no draft model at all (lent lookup steps, lent prefill); ``"hedged"``:
    ``designed``, and also ready wherever the target's own token is among the draft's
    next choices there (``second``: a set of tokens a position) or its top-1 after a
    served lookup copy, as free hedges would be: a bound on any hedge on those choices."""
    ctx = np.asarray(p + o, dtype=np.int64)
    # each step advances n + 1 tokens when all are accepted: the draft makes n + 1 (its
    # guess of the target's own next token included) while the target verifies n
    n_model = max(1, min(k, int((t1 - d) // max(d - c, 1e-9)) - overhead_calls))
    plain = len(p) * prefill_target * tl / t1 + (len(o) - 1) * tl
    if ready_rule == "lookups":
        t, ready = len(p) * prefill_target * tl / t1, float("inf")
    else:
        t, ready = len(p) * prefill_target, len(window_prompt(p, window)) * prefill_draft
    i, hit = 1, False

    def chain(m):  # the model's draft of m tokens: accepted as far as it guesses right
        r = 0
        while i + r < len(o) and r < m and guess[i + r] == o[i + r]:
            r += 1
        return r

    while i < len(o):
        lk = find_continuation(ctx[:len(p) + i], k, 2, 8).tolist()
        lk = lk[:paying_length(1.0, 0.74, len(lk), c / tl)]
        a_l = common_prefix(lk, o[i:])
        own = t1 if busy_prefill and t < ready < float("inf") else tl  # a lookup step's T
        options = [((a_l + 1) / (own + c * len(lk)), own + c * len(lk), a_l, len(lk))]
        if t >= ready:
            if ready_rule == "oracle" or hit:
                tries = [(n_model, 0.0)]
            elif ready_rule == "spot":
                tries = [(m, m * d) for m in range(1, 5)]
            else:
                tries = []
            for m, wait in tries:
                r = chain(m)
                a, served = (r, m) if r >= a_l else (a_l, max(len(lk), m))
                step = wait + t1 + c * served
                options.append(((a + 1) / step, step, a, served))
        _, step, a, served = max(options)
        t += step
        pos = i + a
        hit = pos < len(o) and ((a == served and guess[pos] == o[pos]) or (
            ready_rule == "hedged" and (guess[pos] == o[pos] or o[pos] in second[pos])))
        i += a + 1
    return plain, t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--results", nargs="*",
                    default=sorted(glob.glob(os.path.join(here, "results", "*"))))
    ap.add_argument("--draft", default=None,
                    help="draft GGUF (default: the package's, as DuoProposer prepares it)")
    ap.add_argument("--t1", type=float, default=0.136, help="target step, own cores, s")
    ap.add_argument("--tl", type=float, default=0.099, help="target step, every core, s")
    ap.add_argument("--c", type=float, default=0.008, help="verify, per draft token, s")
    ap.add_argument("--d", type=float, default=0.040, help="draft call, one token, s")
    ap.add_argument("--overhead-calls", type=int, default=1,
                    help="for the last two rows: draft calls a step that add no token (one: "
                         "the pre-draft's deadline cuts the last call a step)")
    ap.add_argument("--prefill-target", type=float, default=0.0014)
    ap.add_argument("--prefill-draft", type=float, default=0.006)
    ap.add_argument("--window", type=int, default=0,
                    help="the draft's window of the prompt, tokens (0: the whole prompt)")
    ap.add_argument("--busy-prefill", action="store_true",
                    help="lookup steps before the draft's prefill ends run on the target's own "
                         "cores, not lent (the draft's core is prefilling)")
    ap.add_argument("--best-of-lookups", action="store_true",
                    help="per request, the faster of the rule and lookups alone (no draft "
                         "model: lent steps and a lent prefill), as a per-request gate could")
    ap.add_argument("--hedge-width", type=int, default=2,
                    help="the hedged bound's choices a position, the draft's top-1 included")
    args = ap.parse_args(argv)
    if args.hedge_width < 2:
        ap.error("--hedge-width must be at least 2")
    from duo_vllm.models import default_draft_gguf, prepare_draft

    rows = stored_outputs(args.results)
    if not rows:  # the committed results keep no engines/ folders (git-ignored raw outputs)
        ap.error("no plain vLLM greedy outputs (engines/plain-*.out.json) under "
                 f"{args.results or 'benchmarks/results/*'}: run `python -m benchmarks.run "
                 "--methods plain-all --batch-sizes 1 --temperatures 0 --sampled-batch-sizes "
                 "--staggered 0 --out DIR` first and pass --results DIR")
    guesses, seconds = draft_guesses(args.draft or prepare_draft(default_draft_gguf()), rows,
                                     args.window, rank=args.hedge_width)
    agree = np.mean([np.mean(np.asarray(g) == np.asarray(o))
                     for (_, _, o), g in zip(rows, guesses)])
    seen = f"window {args.window}" if args.window else "whole context"
    print(f"{len(rows)} prompts; the draft's greedy guess agrees with the target's at "
          f"{agree:.3f} of positions ({seen})")
    print(f"cost table: t1 {args.t1 * 1e3:.0f} ms, every core {args.tl * 1e3:.0f} ms, verify "
          f"{args.c * 1e3:.1f} ms/token, draft {args.d * 1e3:.1f} ms/token, prefill target "
          f"{args.prefill_target * 1e3:.1f} / draft {args.prefill_draft * 1e3:.1f} ms/token"
          + (", lookups beside the draft's prefill on the target's cores" if args.busy_prefill
             else "") + (", each request the better of it and lookups alone"
                         if args.best_of_lookups else ""))
    topk = np.mean([np.mean([t == a or t in b for t, a, b in zip(o, g, s)])
                    for (_, _, o), g, s in zip(rows, guesses, seconds)])
    print(f"its top {args.hedge_width} hold the target's token at {topk:.3f} of positions")
    for rule, over in (("lookups", 0), ("oracle", 0), ("designed", 0), ("spot", 0),
                       ("hedged", 0), ("designed", args.overhead_calls),
                       ("spot", args.overhead_calls)):
        per_task: dict = {}
        for (task, p, o), g, s in zip(rows, guesses, seconds):
            def run(r):
                return replay(p, o, g, args.t1, args.tl, args.c, args.d, args.prefill_target,
                              args.prefill_draft, r, overhead_calls=over, window=args.window,
                              busy_prefill=args.busy_prefill, second=s)
            plain, t = run(rule)
            if args.best_of_lookups and rule != "lookups":
                t = min(t, run("lookups")[1])
            per_task.setdefault(task, []).append(plain / t)
        every = [x for v in per_task.values() for x in v]
        label = rule + (f", {over} call(s) fewer" if over else "")
        print(f"{label:28s} all {np.median(every):.2f}x plain on every core; " + ", ".join(
            f"{task} {np.median(v):.2f}x" for task, v in sorted(per_task.items())))


if __name__ == "__main__":
    main()
