"""Where a vLLM step's time goes where no row has drafts: plain vLLM against DuoProposer
(issue 63, item 1).

One in-process engine per call (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core
runs in this process, so py-spy sees it), target on cores 0-1:

* ``plain``: no speculative config;
* ``duo-capped``: DuoProposer (duo-lend) with ``max_batch: 1``: above batch 1 the
  proposer does no draft work, every step is draft-free;
* ``duo``: DuoProposer as installed (duo-lend).

It runs one untimed ``generate()`` of ``--batch`` Spec-Bench prompts (greedy,
``ignore_eos``, ``--tokens``), then ``--rounds`` timed ones under
``py-spy record --format raw`` attached to this process, and writes the collapsed stacks
and a JSON summary (per-function inclusive ms per engine step, steps, drafted steps,
round seconds, DuoProposer.propose() timed in-process) to ``--out``:

    python -m benchmarks.step_profile plain --batch 4 --rounds 3
    python -m benchmarks.step_profile table benchmarks/results/step_profile/b4-*.json

``table`` prints the per-function comparison of the modes' summaries (ms/step and the
differences to plain), and the functions that differ most.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("plain", "duo-capped", "duo")
DUO_LEND = {"parallel": True, "multi_sequence": True, "budget": "auto"}
K, LOOKUP_K = 4, 8  # benchmarks.run's defaults (--k, --lookup-k)

# (label, function name, file substring): inclusive time of each, by py-spy frame
FUNCTIONS = [
    ("LLM._run_engine (whole)", "_run_engine", "vllm/entrypoints/"),
    ("LLMEngine.step", "step", "v1/engine/llm_engine.py"),
    ("EngineCore.step", "step", "v1/engine/core.py"),
    ("  Scheduler.schedule", "schedule", "core/sched/scheduler.py"),
    ("  Executor.execute_model", "execute_model", "v1/executor/"),
    ("    runner.execute_model", "execute_model", "worker/gpu_model_runner.py"),
    ("      _update_states (duo hook)", "_update_states", "duo_vllm/vllm/patches.py"),
    ("        proposer.on_new_requests", "on_new_requests", "duo_vllm/"),
    ("        proposer.before_step", "before_step", "duo_vllm/"),
    ("      runner._update_states", "_update_states", "worker/gpu_model_runner.py"),
    ("      _prepare_inputs", "_prepare_inputs", "worker/gpu_model_runner.py"),
    ("        _calc_spec_decode_metadata", "_calc_spec_decode_metadata",
     "worker/gpu_model_runner.py"),
    ("      _preprocess", "_preprocess", "worker/gpu_model_runner.py"),
    ("      _model_forward", "_model_forward", "worker/gpu_model_runner.py"),
    ("      compute_logits", "compute_logits", "model_executor/"),
    ("  Executor.sample_tokens", "sample_tokens", "v1/executor/"),
    ("    runner.sample_tokens", "sample_tokens", "worker/gpu_model_runner.py"),
    ("      _sample (duo wraps)", "_sample", "duo_vllm/vllm/patches.py"),
    ("      runner._sample", "_sample", "worker/gpu_model_runner.py"),
    ("        Sampler.forward", "forward", "v1/sample/sampler.py"),
    ("        RejectionSampler.forward", "forward", "v1/sample/rejection_sampler.py"),
    ("      _bookkeeping_sync", "_bookkeeping_sync", "worker/gpu_model_runner.py"),
    ("      propose_draft_token_ids (duo)", "_propose_draft_token_ids",
     "duo_vllm/vllm/patches.py"),
    ("      propose_draft_token_ids", "propose_draft_token_ids",
     "worker/gpu_model_runner.py"),
    ("        DuoProposer.propose", "propose", "duo_vllm/vllm/proposer.py"),
    ("      _get_spec_decode_draft_probs", "_get_spec_decode_draft_probs",
     "worker/gpu_model_runner.py"),
    ("      _update_states_after_model_execute", "_update_states_after_model_execute",
     "worker/gpu_model_runner.py"),
    ("  Scheduler.update_from_output", "update_from_output", "core/sched/scheduler.py"),
    ("EngineCore.post_step", "post_step", "v1/engine/core.py"),
    ("  take_draft_token_ids (runner)", "take_draft_token_ids",
     "worker/gpu_model_runner.py"),
    ("  Scheduler.update_draft_token_ids", "update_draft_token_ids",
     "core/sched/scheduler.py"),
    ("OutputProcessor.process_outputs", "process_outputs", "v1/engine/output_processor.py"),
    ("  detokenizer.update", "update", "v1/engine/detokenizer.py"),
    ("any duo_vllm frame", None, "duo_vllm/"),
]
FRAME = re.compile(r"^(?P<name>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def parse_frame(frame: str) -> tuple[str, str]:
    m = FRAME.match(frame.strip())
    return (m.group("name"), m.group("file")) if m else (frame.strip(), "")


def same(qualname: str, name: str) -> bool:
    """py-spy names frames by qualified name (``GPUModelRunner.execute_model``,
    ``with_new_request_hook.<locals>._update_states``)."""
    return qualname == name or qualname.endswith("." + name)


def aggregate(raw: Path) -> dict:
    """Inclusive samples per function of interest and per (name, file) of every vllm /
    duo_vllm frame, from py-spy's collapsed stacks; ``total`` counts the stacks of the
    thread running ``generate()``."""
    wanted = collections.Counter()
    every = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [parse_frame(f) for f in stack.split(";")]
        if not any(same(name, "generate") and "entrypoints/llm.py" in file
                   for name, file in frames):
            continue  # other threads
        total += n
        for label, name, file in FUNCTIONS:
            if any((name is None or same(fn, name)) and file in ff for fn, ff in frames):
                wanted[label] += n
        seen = {(fn, ff.split("site-packages/")[-1]) for fn, ff in frames
                if "vllm" in ff}
        for key in seen:
            every[f"{key[0]} ({key[1]})"] += n
    return {"total": total, "functions": dict(wanted), "every": dict(every)}


def build_llm(mode: str, target: str):
    from vllm import LLM

    from duo_vllm.cli import speculative_config
    from duo_vllm.config import nest_tuning

    spec = None
    if mode != "plain":
        duo = dict(DUO_LEND, draft_cores=[1], max_draft_len=K)
        if mode == "duo-capped":
            duo["max_batch"] = 1
        spec = speculative_config(LOOKUP_K, nest_tuning(duo))  # benchmarks.run.method_spec
    return LLM(model=target, max_model_len=2048, seed=0, dtype="float32",
               speculative_config=spec), spec


# (label, module, class, method): timed in-process (wall and this thread's CPU time,
# inclusive): CPU time does not count the time other processes take the cores from us
TIMED = [
    ("EngineCore.step", "vllm.v1.engine.core", "EngineCore", "step"),
    ("  Scheduler.schedule", "vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("  runner.execute_model", GPU_RUNNER := "vllm.v1.worker.gpu_model_runner",
     "GPUModelRunner", "execute_model"),
    ("    runner._update_states (+duo hook)", GPU_RUNNER, "GPUModelRunner", "_update_states"),
    ("    _prepare_inputs", GPU_RUNNER, "GPUModelRunner", "_prepare_inputs"),
    ("      _calc_spec_decode_metadata", GPU_RUNNER, "GPUModelRunner",
     "_calc_spec_decode_metadata"),
    ("    _build_attention_metadata", GPU_RUNNER, "GPUModelRunner",
     "_build_attention_metadata"),
    ("    _model_forward", GPU_RUNNER, "GPUModelRunner", "_model_forward"),
    ("  runner.sample_tokens", GPU_RUNNER, "GPUModelRunner", "sample_tokens"),
    ("    _sample (+duo wraps)", GPU_RUNNER, "GPUModelRunner", "_sample"),
    ("      Sampler.forward", "vllm.v1.sample.sampler", "Sampler", "forward"),
    ("      RejectionSampler.forward", "vllm.v1.sample.rejection_sampler",
     "RejectionSampler", "forward"),
    ("    _update_states_after_model_execute", GPU_RUNNER, "GPUModelRunner",
     "_update_states_after_model_execute"),
    ("    _bookkeeping_sync", GPU_RUNNER, "GPUModelRunner", "_bookkeeping_sync"),
    ("    propose_draft_token_ids (+duo q hook)", GPU_RUNNER, "GPUModelRunner",
     "propose_draft_token_ids"),
    ("      DuoProposer.propose", "duo_vllm.vllm.proposer", "DuoProposer", "propose"),
    ("  Scheduler.update_from_output", "vllm.v1.core.sched.scheduler", "Scheduler",
     "update_from_output"),
    ("EngineCore.post_step", "vllm.v1.engine.core", "EngineCore", "post_step"),
    ("  runner.take_draft_token_ids", GPU_RUNNER, "GPUModelRunner", "take_draft_token_ids"),
    ("  Scheduler.update_draft_token_ids", "vllm.v1.core.sched.scheduler", "Scheduler",
     "update_draft_token_ids"),
    ("OutputProcessor.process_outputs", "vllm.v1.engine.output_processor",
     "OutputProcessor", "process_outputs"),
]


class Timers:
    """Inclusive wall and thread-CPU time of the :data:`TIMED` methods while ``on``.
    Installed before the engine is built: duo_vllm's patches then wrap these wrappers."""

    def __init__(self):
        self.on = False
        self.calls = collections.Counter()
        self.wall_ns = collections.Counter()
        self.cpu_ns = collections.Counter()

    def install(self, mode: str) -> None:
        import importlib

        for label, module, cls_name, attr in TIMED:
            if mode == "plain" and module.startswith("duo_vllm"):
                continue
            try:
                cls = getattr(importlib.import_module(module), cls_name)
                setattr(cls, attr, self.wrap(label, getattr(cls, attr)))
            except Exception as e:  # a vLLM without it: not timed
                print(f"step_profile: {label} not timed ({e!r})", file=sys.stderr)

    def wrap(self, label: str, fn):
        timers = self

        def timed(*a, **kw):
            if not timers.on:
                return fn(*a, **kw)
            w, c = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return fn(*a, **kw)
            finally:
                timers.cpu_ns[label] += time.thread_time_ns() - c
                timers.wall_ns[label] += time.perf_counter_ns() - w
                timers.calls[label] += 1

        timed.__name__, timed.__qualname__ = fn.__name__, fn.__qualname__
        timed.__doc__, timed.__wrapped__ = fn.__doc__, fn
        return timed

    def summary(self) -> dict:
        return {k: {"calls": self.calls[k], "wall_ms": self.wall_ns[k] / 1e6,
                    "cpu_ms": self.cpu_ns[k] / 1e6} for k in self.calls}


class Counters:
    """Engine steps (EngineCore.step that ran the model), steps that verified drafts, and
    DuoProposer.propose()'s own time, counted while ``on``."""

    def __init__(self):
        self.on = False
        self.steps = self.drafted_steps = self.draft_tokens = 0
        self.propose_ns: list[int] = []
        self.propose_ns_capped: list[int] = []  # on steps whose batch exceeds max_batch

    def install(self, mode: str) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore

        counters = self
        step = EngineCore.step

        def counted_step(self_, *a, **kw):
            out = step(self_, *a, **kw)
            if counters.on and out[1]:
                counters.steps += 1
            return out

        EngineCore.step = counted_step
        schedule = Scheduler.schedule

        def counted_schedule(self_, *a, **kw):
            out = schedule(self_, *a, **kw)
            spec = getattr(out, "scheduled_spec_decode_tokens", None) or {}
            n = sum(len(v) for v in spec.values())
            if counters.on and n:
                counters.drafted_steps += 1
                counters.draft_tokens += n
            return out

        Scheduler.schedule = counted_schedule
        if mode == "plain":
            return
        from duo_vllm.vllm.proposer import DuoProposer

        propose = DuoProposer.propose

        def timed_propose(self_, sampled_token_ids, *a, **kw):
            t = time.perf_counter_ns()
            try:
                return propose(self_, sampled_token_ids, *a, **kw)
            finally:
                dt = time.perf_counter_ns() - t
                if counters.on:
                    counters.propose_ns.append(dt)
                    if len(sampled_token_ids) > 1:
                        counters.propose_ns_capped.append(dt)

        DuoProposer.propose = timed_propose


def ns_summary(values: list[int]) -> dict:
    if not values:
        return {}
    v = sorted(values)
    return {"calls": len(v), "median_us": v[len(v) // 2] / 1e3,
            "p90_us": v[int(len(v) * 0.9)] / 1e3, "mean_us": sum(v) / len(v) / 1e3,
            "max_us": v[-1] / 1e3}


def start_pyspy(path: Path, rate: int) -> subprocess.Popen:
    cmd = ["py-spy", "record", "--format", "raw", "--rate", str(rate), "--nonblocking",
           "--pid", str(os.getpid()), "--output", str(path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(2.0)  # let it attach
    if proc.poll() is not None:
        raise RuntimeError("py-spy exited: " + proc.stderr.read().decode()[-800:])
    return proc


def stop_pyspy(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def run(args) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from duo_vllm.models import prepare_default_target
    from tests.support.specbench import chat_prompts, load_specbench

    target = args.target or prepare_default_target()
    counters = Counters()
    counters.install(args.mode)
    timers = Timers()
    if not args.no_timers:
        timers.install(args.mode)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(target),
                           [text for _, text in load_specbench(per_task=2)])
    prompts = [prompts[i % len(prompts)] for i in range(args.batch)]
    llm, spec = build_llm(args.mode, target)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"b{args.batch}-{args.mode}"
    raw = out / f"{stem}.raw.txt"
    spy = None if args.no_pyspy else start_pyspy(raw, args.rate)
    counters.on = timers.on = True
    cpu0 = time.thread_time()
    seconds = []
    try:
        for _ in range(args.rounds):
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds.append(time.perf_counter() - t)
    finally:
        counters.on = timers.on = False
        cpu_s = time.thread_time() - cpu0
        if spy is not None:
            stop_pyspy(spy)
    summary = {"mode": args.mode, "batch": args.batch, "tokens": args.tokens,
               "rounds": args.rounds, "rate": args.rate, "spec": spec,
               "seconds": seconds, "median_s": statistics.median(seconds),
               "steps": counters.steps, "drafted_steps": counters.drafted_steps,
               "draft_tokens": counters.draft_tokens,
               "propose": ns_summary(counters.propose_ns),
               "propose_batch_gt1": ns_summary(counters.propose_ns_capped),
               "load": os.getloadavg(), "main_thread_cpu_s": cpu_s,
               "timers": timers.summary()}
    if spy is not None and raw.exists():
        summary["profile"] = aggregate(raw)
        summary["raw"] = str(raw.resolve())
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=1))
    short = {k: v for k, v in summary.items() if k not in ("profile", "spec")}
    print(json.dumps(short))


def table(paths: list[str], top: int) -> None:
    runs = {}
    for p in paths:
        s = json.loads(Path(p).read_text())
        raw = Path(s.get("raw") or Path(p).with_suffix(".raw.txt"))
        if raw.exists():  # aggregated afresh: FUNCTIONS may have changed since
            s["profile"] = aggregate(raw)
        runs[s["mode"]] = s
    modes = [m for m in MODES if m in runs]

    def per_step(s: dict, samples: int) -> float:
        """ms per engine step: samples scaled so that the generate() thread's samples
        add up to the timed rounds' wall time (py-spy may fall behind its rate)."""
        prof = s["profile"]
        wall_ms = sum(s["seconds"]) * 1e3
        return samples * wall_ms / max(prof["total"], 1) / max(s["steps"], 1)

    batch = runs[modes[0]]["batch"]
    print(f"\n## batch {batch}: ms per engine step (inclusive, py-spy)\n")
    for m in modes:
        s = runs[m]
        p = s.get("propose_batch_gt1") or {}
        print(f"- {m}: rounds {', '.join(f'{x:.2f}' for x in s['seconds'])} s "
              f"(median {s['median_s']:.2f}), {s['steps']} steps "
              f"({s['steps'] / s['rounds']:.0f}/round), {s['drafted_steps']} with drafts "
              f"({s['draft_tokens']} draft tokens), {s['profile']['total']} samples, "
              f"{sum(s['seconds']) * 1e3 / max(s['steps'], 1):.1f} ms/step wall"
              + (f"; propose() at batch>1: median {p['median_us']:.0f} us, "
                 f"mean {p['mean_us']:.0f} us, p90 {p['p90_us']:.0f} us "
                 f"over {p['calls']} calls" if p else ""))
    if any(runs[m].get("timers") for m in modes):
        print("\n### timed in-process: this thread's CPU ms per step (wall ms in brackets)\n")
        head = "| function | " + " | ".join(modes) + " | " + " | ".join(
            f"{m} - plain (CPU)" for m in modes if m != "plain") + " |"
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        for label, *_ in TIMED:
            cells, cpu = [], {}
            for m in modes:
                t = (runs[m].get("timers") or {}).get(label)
                steps = max(runs[m]["steps"], 1)
                cpu[m] = t["cpu_ms"] / steps if t else 0.0
                cells.append(f"{cpu[m]:.3f} ({t['wall_ms'] / steps:.2f}), "
                             f"{t['calls'] / steps:.2f} calls" if t else "-")
            diffs = [f"{cpu[m] - cpu['plain']:+.3f}" if runs[m].get("timers")
                     and runs.get("plain", {}).get("timers") else "-"
                     for m in modes if m != "plain"]
            print(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(diffs) + " |")
        print("| main thread CPU, whole rounds | " + " | ".join(
            f"{runs[m].get('main_thread_cpu_s', float('nan')) * 1e3 / max(runs[m]['steps'], 1):.2f}"
            for m in modes) + " |")
        print("\n### py-spy samples: ms per step (inclusive, scaled to wall time)")
    head = "| function | " + " | ".join(modes) + " | " + " | ".join(
        f"{m} - plain" for m in modes if m != "plain") + " |"
    print("\n" + head)
    print("|" + "---|" * (head.count("|") - 1))
    for label, _, _ in FUNCTIONS:
        vals = {m: per_step(runs[m], runs[m]["profile"]["functions"].get(label, 0))
                for m in modes}
        diffs = [f"{vals[m] - vals['plain']:+.2f}" for m in modes
                 if m != "plain" and "plain" in vals]
        print(f"| {label} | " + " | ".join(f"{vals[m]:.2f}" for m in modes) + " | "
              + " | ".join(diffs) + " |")
    if "plain" not in runs:
        return
    keys = set()
    for m in modes:
        keys |= set(runs[m]["profile"]["every"])
    rows = []
    for k in keys:
        vals = {m: per_step(runs[m], runs[m]["profile"]["every"].get(k, 0)) for m in modes}
        spread = max(abs(vals[m] - vals["plain"]) for m in modes)
        rows.append((spread, k, vals))
    rows.sort(reverse=True)
    print(f"\n### the {top} vllm/duo_vllm functions whose ms/step differ most from plain\n")
    print("| function (file) | " + " | ".join(modes) + " |")
    print("|---|" + "---|" * len(modes))
    for _, k, vals in rows[:top]:
        print(f"| {k} | " + " | ".join(f"{vals[m]:.2f}" for m in modes) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=MODES + ("table",))
    ap.add_argument("paths", nargs="*", help="table: the summaries to compare")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rate", type=int, default=250)
    ap.add_argument("--target", help="default: duo_vllm.models.prepare_default_target()")
    ap.add_argument("--out", default="benchmarks/results/step_profile")
    ap.add_argument("--no-pyspy", action="store_true")
    ap.add_argument("--no-timers", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    if args.mode == "table":
        table(args.paths, args.top)
    else:
        run(args)


if __name__ == "__main__":
    sys.exit(main())
