"""The draft side on a GPU host, without vLLM: ``python -m benchmarks.gpu_host --out DIR``.

What DuoProposer's draft meets on a GPU server, measured where vLLM cannot be
installed (the lent GPU machines):

- whether this llama-cpp-python build can offload to a GPU at all (the one
  ``scripts/install.sh`` builds, like PyPI's source build, is CPU-only);
- the draft's decode call by width, pinned to CPU cores, with the GPU idle and
  beside a busy CUDA process (bf16 matrix products in a loop, its host thread
  pinned to a core of its own, as vLLM's target process is);
- the round trip of one width-1 draft call to a pinned draft process, over a
  pipe, and (``--ray N``, with Ray carried there) through a Ray actor, idle
  and busy: what a step pays beyond the call.

The default draft (98 MB) cannot travel to such a host, so ``--skeleton`` makes
a draft with its architecture, metadata and tensor shapes and random weights
(a decode call's time depends on shapes, not values), re-quantised to Q8_0 as
``draft_quant: "auto"`` does::

    python -m benchmarks.gpu_host --write-skeleton skel.json.gz   # here
    python -m benchmarks.gpu_host --skeleton skel.json.gz --out DIR  # there
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

WIDTHS = (1, 2, 4, 8)


def write_skeleton(gguf_path: str, out: str) -> None:
    """``gguf_path``'s metadata and tensor shapes (no weights), gzipped JSON."""
    from gguf import GGUFReader

    r = GGUFReader(gguf_path)
    fields = []
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.file_type":
            continue
        fields.append({"key": name, "types": [int(t) for t in f.types],
                       "value": f.contents()})
    tensors = [{"name": t.name, "ne": [int(x) for x in t.shape]} for t in r.tensors]
    with gzip.open(out, "wt") as fh:
        json.dump({"source": os.path.basename(gguf_path), "fields": fields,
                   "tensors": tensors}, fh)


def draft_from_skeleton(skeleton: str, path: str, seed: int = 0) -> None:
    """A GGUF with the skeleton's metadata and shapes and random weights: matrices
    in float16, vectors (norms) in float32."""
    from gguf import GGUFValueType, GGUFWriter

    with gzip.open(skeleton, "rt") as fh:
        sk = json.load(fh)
    arch = next(f["value"] for f in sk["fields"] if f["key"] == "general.architecture")
    w = GGUFWriter(path, arch)
    for f in sk["fields"]:
        if f["key"] == "general.architecture":
            continue
        vtype = GGUFValueType(f["types"][0])
        sub = GGUFValueType(f["types"][-1]) if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(f["key"], f["value"], vtype, sub_type=sub)
    rng = np.random.default_rng(seed)
    for t in sk["tensors"]:
        shape = tuple(reversed(t["ne"]))  # numpy order
        if len(shape) == 1:
            w.add_tensor(t["name"], np.ones(shape, dtype=np.float32))
        else:
            w.add_tensor(t["name"], (0.02 * rng.standard_normal(shape, dtype=np.float32))
                         .astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gpu_load(seconds: float, ready) -> None:
    """A busy CUDA process: bf16 8192^3 products back to back for ``seconds``."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    ready.set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()


def start_gpu_load(core: int, seconds: float):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_pinned, args=(core, gpu_load, seconds, ready), daemon=True)
    p.start()
    if not ready.wait(120):
        raise RuntimeError("the CUDA load did not start")
    return p


def _pinned(core, fn, *args):
    os.sched_setaffinity(0, [core])
    fn(*args)


def decode_by_width(model: str, cores: list[int], repeats: int) -> dict:
    """ms per decode call by width (``WIDTHS``), as ``benchmarks.profile_draft`` measures
    it: pinned to ``cores``, after a 256-token context."""
    from benchmarks.profile_draft import profile

    decode = profile(model, cores, repeats)["decode"]
    return {w: decode[w]["ms_per_call"] for w in WIDTHS}


class Decoder:
    """The draft pinned to ``cores`` after a 256-token context: ``step`` runs one
    width-1 decode call and returns its seconds."""

    def __init__(self, model: str, cores: list[int]):
        from duo_vllm.runtime.actor import pin_process
        from duo_vllm.draft.backend import LlamaCppBackend

        pin_process(cores)
        self.be = LlamaCppBackend(model, n_ctx=2048, n_seq=1, n_threads=len(cores))
        self.prompt = np.arange(100, 356, dtype=np.int32)
        self.be.decode([(0, self.prompt, 0)])
        self.pos = len(self.prompt)

    def ready(self) -> bool:
        return True

    def step(self, token: int) -> float:
        t0 = time.perf_counter()
        self.be.decode([(0, np.array([token], dtype=np.int32), self.pos)])
        self.pos += 1
        if self.pos > 2000:
            self.be.remove(0, len(self.prompt), -1)
            self.pos = len(self.prompt)
        return time.perf_counter() - t0


def _worker(model: str, cores: list[int], conn) -> None:
    """A pinned draft process: answers each request with one width-1 decode call."""
    d = Decoder(model, cores)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        conn.send(d.step(msg))
    d.be.close()


def _timed(call, repeats: int) -> dict:
    trips, calls = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        calls.append(call(100 + i % 1000))
        trips.append(time.perf_counter() - t0)
    return {"round_trip_ms": 1e3 * statistics.median(trips),
            "call_ms": 1e3 * statistics.median(calls),
            "overhead_ms": 1e3 * statistics.median(t - c for t, c in zip(trips, calls))}


def ray_round_trip(model: str, cores: list[int], caller_core: int, repeats: int) -> dict:
    """The same call through a Ray actor (a private local Ray, as DuoProposer's default)."""
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             num_cpus=len(cores) + 1)
    try:
        actor = ray.remote(num_cpus=0)(Decoder).remote(model, cores)
        ray.get(actor.ready.remote())
        with _pinned_to(caller_core):  # Ray's daemons stay unpinned
            return _timed(lambda tok: ray.get(actor.step.remote(tok)), repeats)
    finally:
        ray.shutdown()


def round_trip(model: str, cores: list[int], caller_core: int, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_worker, args=(model, cores, there), daemon=True)
    p.start()
    assert here.recv() == "ready"
    def call(tok):
        here.send(tok)
        return here.recv()

    with _pinned_to(caller_core):
        out = _timed(call, repeats)
    here.send(None)
    p.join(10)
    return out


class _pinned_to:
    """The calling process on ``core`` for the block, its CPUs as before after it."""

    def __init__(self, core: int):
        self.core = core

    def __enter__(self):
        self.before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, [self.core])

    def __exit__(self, *exc):
        os.sched_setaffinity(0, self.before)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def host_facts() -> dict:
    facts = {"python": platform.python_version(), "cpus": os.cpu_count(),
             "allowed_cpus": len(os.sched_getaffinity(0))}
    try:
        facts["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                            if line.startswith("model name"))
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
        facts["avx512f"] = " avx512f" in flags
    except (OSError, StopIteration):
        pass
    try:
        facts["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                                       "--format=csv,noheader"], capture_output=True,
                                      text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        facts["gpu"] = None
    import llama_cpp

    facts["llama_cpp_python"] = llama_cpp.__version__
    facts["llama_supports_gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    # what a GPU build would offload unless told: LlamaCppBackend passes n_gpu_layers=0
    facts["default_n_gpu_layers"] = int(llama_cpp.llama_model_default_params().n_gpu_layers)
    return facts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-skeleton", metavar="OUT",
                    help="write the default draft's skeleton here and stop")
    ap.add_argument("--skeleton", help="make a random-weight draft from this skeleton")
    ap.add_argument("--draft", help="a GGUF to measure instead")
    ap.add_argument("--cores", type=int, nargs="+", default=[1, 2, 4],
                    help="draft core counts to measure (the last CPUs of the host)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--ray", type=int, default=0, metavar="N",
                    help="also through a Ray actor pinned to the last N CPUs")
    ap.add_argument("--busy-first", action="store_true",
                    help="measure beside the busy CUDA process first (order effects)")
    ap.add_argument("--out", default="benchmarks/results/gpu-host")
    args = ap.parse_args(argv)
    if not (args.write_skeleton or args.skeleton or args.draft):
        ap.error("give --draft GGUF or --skeleton FILE (or --write-skeleton OUT)")
    if not args.write_skeleton and len(os.sched_getaffinity(0)) < 3:
        ap.error("needs 3 CPUs or more: the GPU load, the caller and the draft each get one")
    if args.write_skeleton:
        from duo_vllm.models import default_draft_gguf

        write_skeleton(default_draft_gguf(), args.write_skeleton)
        return 0
    os.makedirs(args.out, exist_ok=True)
    res = {"host": host_facts()}
    print(json.dumps(res["host"]), flush=True)
    model = args.draft
    if model is None:
        from duo_vllm.draft.backend import requantize

        import tempfile

        work = tempfile.mkdtemp(prefix="duo-gpu-host-")  # removed with the draft, below
        f16 = os.path.join(work, "draft-random-f16.gguf")
        t0 = time.perf_counter()
        draft_from_skeleton(args.skeleton, f16)
        model = os.path.join(work, "draft-random-q8_0.gguf")
        requantize(f16, model, "q8_0", n_threads=4)
        os.remove(f16)
        res["draft"] = {"from_skeleton": args.skeleton, "made_s": time.perf_counter() - t0}
    cpus = sorted(os.sched_getaffinity(0))
    load_core, caller_core = cpus[0], cpus[1]
    res["decode_ms_by_width"], res["round_trip"] = {}, {}
    gpu = _has_cuda()
    res["host"]["cuda"] = gpu
    order = ((True, False) if args.busy_first else (False, True)) if gpu else (False,)
    res["order"] = ["gpu_busy" if b else "gpu_idle" for b in order]
    for busy in order:
        load = start_gpu_load(load_core, 3600) if busy else None  # stopped below
        label = "gpu_busy" if busy else "gpu_idle"
        try:
            for n in args.cores:
                cores = cpus[-n:]
                ctx = mp.get_context("spawn")
                with ctx.Pool(1) as pool:  # a fresh process per measurement: its own pinning
                    by_width = pool.apply(decode_by_width, (model, cores, args.repeats))
                res["decode_ms_by_width"][f"{label}, {n} core(s)"] = by_width
                print(label, n, "cores:", {w: round(v, 2) for w, v in by_width.items()},
                      flush=True)
            trip = round_trip(model, cpus[-1:], caller_core, 4 * args.repeats)
            res["round_trip"][label] = trip
            print(label, "round trip:", {k: round(v, 3) for k, v in trip.items()}, flush=True)
            if args.ray:
                trip = ray_round_trip(model, cpus[-args.ray:], caller_core, 4 * args.repeats)
                res["round_trip"][f"{label}, ray, {args.ray} core(s)"] = trip
                print(label, "ray round trip:", {k: round(v, 3) for k, v in trip.items()},
                      flush=True)
        finally:
            if load is not None:
                load.terminate()
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    if args.draft is None:
        os.remove(model)
        os.rmdir(os.path.dirname(model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
