"""Interleaved engines: the benchmark mode that can see a few percent.

    python -m benchmarks.run --interleave 3 --control plain-all \
        --methods plain-all duo-lend --out /tmp/ab

Engines of one version differ by 5-15% per shape on these VMs when they run
one after another, more than most changes are worth. In this mode every
method's engine is started once and kept warm, all of them alive at once,
and each round runs every shape on every engine in turn (the engines' order
rotates from round to round; every engine sees the shapes in the same order).
A warm-up round that is not kept comes first: an engine's first run of a batch
shape builds what that shape needs (oneDNN's matmuls for new row counts) and
took 20-35% longer than the rounds after it, in every engine.
A method's speed in a shape is then the median over rounds of its ratio to
the baseline *in the same round*, with the spread of those ratios: drift
between rounds cancels out of each ratio. ``--control M`` adds a second
engine of method M (named ``M~2``): the ratio between two engines of one
version is the resolution of the run. The host's own speed moves by 10-50% in
bursts of seconds, so one round's ratio is good to about 7%: ``markdown`` turns the
control pair's rounds into the half-width of a median and the rounds 2% would take.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .run import (METHODS, Unavailable, base_method, engine_request, shape_key, shapes_of,
                  worker_command)

# vLLM's engine core spins for about a second after its last step: the next engine's
# measurement starts after it
SETTLE_S = 1.5
WARM_UP = -1  # the warm-up round's number
START_TIMEOUT_S = 900


class Engine:
    """One method's warm engine process, measuring a shape when asked."""

    def __init__(self, name: str, req_path: Path, env: dict, cwd, work: Path):
        self.name, self.work = name, work
        self.ready = work / f"{name}.ready"
        self.ready.unlink(missing_ok=True)
        self.log_path = work / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            worker_command("--serve-worker", str(req_path.resolve()), str(self.ready.resolve())),
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, env=env,
            cwd=cwd, text=True)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> str | None:
        """None once the engine is warm, else why it is not."""
        deadline = time.time() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None:
                return f"exited with {self.proc.returncode} (log {self.log_path})"
            if time.time() > deadline:
                return f"not ready in {timeout:.0f}s (log {self.log_path})"
            time.sleep(0.5)
        return None

    def measure(self, shape: int, rnd: int, timeout: float) -> dict:
        out = self.work / f"{self.name}.s{shape}.r{rnd}.json"
        out.unlink(missing_ok=True)
        self.proc.stdin.write(json.dumps({"shape": shape, "round": rnd, "out": str(out)}) + "\n")
        self.proc.stdin.flush()
        deadline = time.time() + timeout
        while not out.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} "
                                   f"(log {self.log_path})")
            if time.time() > deadline:
                raise RuntimeError(f"{self.name}: shape {shape} round {rnd} took over "
                                   f"{timeout:.0f}s")
            time.sleep(0.05)
        return json.loads(out.read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def run_interleaved(methods: list[str], target: str, prompts, tasks, args, work: Path,
                    draft: str | None, log=print) -> dict:
    """Every method's shapes, ``args.interleave`` rounds: results as ``benchmarks.run``
    keeps them (a row's ``repeat`` is its round)."""
    results, engines = {}, {}
    try:
        for name in methods:  # one at a time: start-up compiles
            try:
                req_path, spec, env, cwd = engine_request(name, target, prompts, tasks,
                                                          args, work, None, draft)
            except Unavailable as e:
                results[name] = {"available": False, "reason": str(e)}
                continue
            engine = Engine(name, req_path, env, cwd, work)
            why = engine.wait_ready()
            if why:
                engine.close()
                results[name] = {"available": False, "reason": why,
                                 "log": str(engine.log_path)}
                log(f"[interleave] {name}: unavailable: {why}")
                continue
            engines[name] = engine
            results[name] = {"available": True, "bind": METHODS[base_method(name)]["bind"],
                             "spec": spec, "shapes": []}
            log(f"[interleave] {name}: ready")
        shapes = shapes_of(args)
        live = list(engines)
        for rnd in (WARM_UP, *range(args.interleave)):  # the warm-up's rows are not kept
            order = live[rnd % len(live):] + live[:rnd % len(live)]
            t0 = time.time()
            for i in range(len(shapes)):
                for name in order:
                    time.sleep(SETTLE_S)
                    got = engines[name].measure(i, rnd, args.method_timeout)
                    if rnd != WARM_UP:
                        _merge(results[name]["shapes"], i, got)
            label = "warm-up round" if rnd == WARM_UP else f"round {rnd + 1}/{args.interleave}"
            log(f"[interleave] {label} in {time.time() - t0:.0f}s")
    finally:
        for engine in engines.values():
            engine.close()
    return results


def _merge(shapes: list, i: int, got: dict) -> None:
    """Add one round of shape ``i`` to the method's shapes (rows appended, vLLM's
    counters summed, the draft side's counters of the last round kept)."""
    if len(shapes) <= i:
        shapes.append(got)
        return
    mine = shapes[i]
    mine["rows"] += got["rows"]
    mine["spec"] = {k: mine["spec"][k] + got["spec"][k] for k in mine["spec"]}
    mine["duo"] = got["duo"] or mine["duo"]


def _per_round(rows: list) -> dict:
    """Round -> tok/s (tokens over seconds of the round's generations), p50 latency,
    median time to first token."""
    out = {}
    for rnd in sorted({x["repeat"] for x in rows}):
        mine = [x for x in rows if x["repeat"] == rnd]
        lat = [v for x in mine for v in x.get("latency_s", [])]
        ttft = [x["ttft_s"] for x in mine if x.get("ttft_s")]
        out[rnd] = {"tok_s": sum(x["tokens"] for x in mine) / sum(x["seconds"] for x in mine),
                    "p50_s": statistics.median(lat) if lat else None,
                    "ttft_s": statistics.median(ttft) if ttft else None}
    return out


def _spread(ratios: list[float]) -> dict:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "rounds": ratios, "half_width": half_width(ratios)}


def half_width(ratios: list[float]) -> float | None:
    """The 95% half-width of a median of per-round ratios, as a fraction: 1.96 x the
    median's standard error, 1.25 sd / sqrt(n) of the ratios' logarithms."""
    if len(ratios) < 2:
        return None
    sd = statistics.stdev(math.log(r) for r in ratios)
    return 1.96 * 1.2533 * sd / math.sqrt(len(ratios))


def rounds_for(ratios: list[float], target: float = 0.02) -> int | None:
    """The rounds after which a median of such ratios is good to ``target`` (95%)."""
    h = half_width(ratios)
    return None if h is None else math.ceil(len(ratios) * (h / target) ** 2)


def paired(results: dict, baseline: str) -> dict:
    """Shape -> method -> the median (and spread) over rounds of the method's per-round
    ratio to ``baseline``: tok/s (higher is better), and where measured p50 latency
    and time to first token (lower is better)."""
    base = results.get(baseline, {})
    if not base.get("available"):
        return {}
    base_shapes = {shape_key(s): _per_round(s["rows"]) for s in base["shapes"]}
    out: dict = {}
    for name, r in results.items():
        if name == baseline or not r.get("available"):
            continue
        for s in r["shapes"]:
            key = shape_key(s)
            ref, mine = base_shapes.get(key, {}), _per_round(s["rows"])
            common = [rnd for rnd in mine if rnd in ref]
            if not common:
                continue
            entry = {"tok_s": _spread([mine[x]["tok_s"] / ref[x]["tok_s"] for x in common])}
            for metric in ("p50_s", "ttft_s"):
                vals = [mine[x][metric] / ref[x][metric] for x in common
                        if mine[x][metric] and ref[x][metric]]
                if vals:
                    entry[metric] = _spread(vals)
            out.setdefault(key, {})[name] = entry
    return out


def markdown(results: dict, rounds: int) -> str:
    """A table per baseline: every method's median per-round ratio, ± its 95% half-width
    (min-max)."""
    lines = [f"**Interleaved: {rounds} rounds** after a warm-up round, the median of "
             "per-round ratios to the baseline, ± its 95% half-width (min-max over rounds); "
             "latency and time to first token: lower is better.", ""]
    for baseline in ("plain-all", "plain-1core"):
        table = paired(results, baseline)
        if not table:
            continue
        names = sorted({n for v in table.values() for n in v},
                       key=lambda n: list(results).index(n))
        names = [n for n in names if METHODS[base_method(n)]["bind"]
                 == METHODS[baseline]["bind"]] or names
        lines += [f"against {baseline}:", "", "| shape | " + " | ".join(names) + " |",
                  "|" + "---|" * (len(names) + 1)]

        def cell(e):
            if not e:
                return "-"
            h = "" if e["half_width"] is None else f" ±{100 * e['half_width']:.1f}%"
            return f"{e['median']:.3f}{h} ({e['min']:.3f}-{e['max']:.3f})"

        for key, methods in table.items():
            lines.append(f"| {key} tok/s | " + " | ".join(
                cell(methods.get(n, {}).get("tok_s")) for n in names) + " |")
            for metric, label in (("p50_s", "p50 latency"), ("ttft_s", "TTFT")):
                if any(metric in methods.get(n, {}) for n in names):
                    lines.append(f"| {key} {label} | " + " | ".join(
                        cell(methods.get(n, {}).get(metric)) for n in names) + " |")
        lines.append("")
        controls = [n for n in names if base_method(n) == baseline]
        for key, methods in table.items():
            for n in controls:
                e = methods[n]["tok_s"]
                if e["half_width"] is not None:
                    lines.append(f"- {key}: the control pair's rounds put a median within "
                                 f"±{100 * e['half_width']:.1f}% (95%); ±2% takes about "
                                 f"{rounds_for(e['rounds'])} rounds")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit("run it through benchmarks.run: python -m benchmarks.run --interleave 3 ...")
