#!/usr/bin/env bash
# The draft on a CUDA build of llama.cpp, on a lent GPU machine (device tool).
#
# What it measures, with llama.cpp's own llama-batched-bench (prompt 256 tokens
# per sequence, 64 decode steps, widths 1, 2, 4, 8 parallel sequences):
#   1. whether the CUDA build offloads the draft by default (no -ngl: the tool
#      prints n_gpu_layers = -1, and at its default verbosity only warnings,
#      e.g. "layer 0 is assigned to device CUDA0"; -v would add the
#      "offloaded N/M layers to GPU" line, not asked for here);
#   2. the whole draft on the GPU (-ngl 99), the GPU idle and beside a busy CUDA
#      process (bf16 8192^3 torch products in a loop, its host thread on CPU 0):
#      the draft sharing the GPU with the target;
#   3. the same build with -ngl 0, with and without --no-op-offload (does the
#      prefill go to the GPU with no layers there?), idle and busy.
# Every run is pinned to CPUs 8-15 with -t 8. The draft is a random-weight GGUF
# of the default draft's shapes (SmolLM2-135M), made from a skeleton and
# quantised to Q8_0 with the freshly built llama-quantize, as the product runs it.
#
# Inputs, made on the dev machine (the folder .cuda/ is git-ignored):
#   .cuda/llama.cpp.tar.gz  llama.cpp as vendored in llama-cpp-python 0.3.36,
#                           trimmed (no models/, docs/, tests/, examples/, the
#                           server and its UI)
#   .cuda/skel.json.gz      python -m benchmarks.gpu_host --write-skeleton .cuda/skel.json.gz
#   .cuda/py/gguf           the gguf Python package (pure Python)
# Run through the device tool:
#   run(command="bash benchmarks/gpu_cuda_draft.sh", carry=[".cuda"], timeout_s=540)
# Output under $OUT: log.txt, build.txt, idle.txt (GPU, idle), busy.txt (GPU,
# busy), cpu.txt (-ngl 0), summary.txt (ms per decode step by width).
# The build has FlashAttention kernels off (GGML_CUDA_FA=OFF) to save build time.

set -u -o pipefail
export PYTHONUNBUFFERED=1
export PATH=$PATH:/usr/local/cuda/bin
OUT=${OUT:-/tmp/gpu-cuda-out}
mkdir -p "$OUT"
REPO=$PWD
W=/tmp/duo-cuda
rm -rf "$W" && mkdir -p "$W"
. benchmarks/gpu_draft_setup.sh

log "start"
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  lscpu | head -25; echo "nproc: $(nproc)"; nvcc --version | tail -2
  cmake --version | head -1; echo "ninja: $(ninja --version 2>/dev/null || echo none)"
  python3 -c 'import sys, numpy; print(sys.version.split()[0], numpy.__version__)'
} >> "$LOG" 2>&1

unpack_and_start_draft
build_llama 380 -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF \
  -DGGML_CUDA_NCCL=OFF
quantize_draft

bench() {  # file label [extra args]
  local f=$1 label=$2; shift 2
  echo "=== $label: $* [$(date +%T)]" >> "$OUT/$f"
  timeout 90 taskset -c 8-15 "$BIN/llama-batched-bench" -m "$MODEL" -c 4096 -b 2048 -ub 512 \
    -npp 256 -ntg 64 -npl 1,2,4,8 -t 8 "$@" >> "$OUT/$f" 2>&1
  echo "=== end $label rc=$?" >> "$OUT/$f"
  log "bench $label done"
}

summary() {  # ms per decode step = 1000 * B / S_TG, and prefill S_PP, by run
  python3 - "$OUT" > "$OUT/summary.txt" 2>&1 <<'EOF'
import re, sys, os
out = sys.argv[1]
for f in ("idle.txt", "busy.txt", "cpu.txt"):
    p = os.path.join(out, f)
    if not os.path.exists(p):
        continue
    label = None
    for line in open(p, errors="replace"):
        if line.startswith("=== ") and not line.startswith("=== end"):
            label = line[4:].split(" [")[0]
            print(f"\n{f} :: {label}")
            print("   B   ms/step(TG)   S_TG t/s   S_PP t/s   T_PP s")
        elif re.search(r"offloaded \d+/\d+ layers|Flash Attention|op_offload|n_gpu_layers =", line):
            print("   ", line.strip()[:160])
        else:
            c = [x.strip() for x in line.strip().strip("|").split("|")]
            if len(c) == 10 and c[0].isdigit():
                pp, tg, b = int(c[0]), int(c[1]), int(c[2])
                s_pp, s_tg, t_pp = float(c[5]), float(c[7]), float(c[4])
                print(f"  {b:2d}   {1000*b/s_tg:9.3f}   {s_tg:9.1f}  {s_pp:9.1f}  {t_pp:7.4f}")
EOF
}

BUSY_PID=""
busy_start() {
  taskset -c 0 python3 - > "$W/busy.log" 2>&1 <<'EOF' &
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
print("ready", flush=True)
t, n = time.perf_counter(), 0
while True:
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    n += 20
    if time.perf_counter() - t > 5:
        print("busy: %.0f TFLOP/s" % (n * 2 * 8192**3 / (time.perf_counter() - t) / 1e12), flush=True)
        t, n = time.perf_counter(), 0
EOF
  BUSY_PID=$!
  for _ in $(seq 60); do grep -q ready "$W/busy.log" 2>/dev/null && break; sleep 1; done
  sleep 10
  log "busy load up (pid $BUSY_PID): $(tail -1 "$W/busy.log")"
}
busy_stop() {
  [ -n "$BUSY_PID" ] && kill "$BUSY_PID" 2>/dev/null && wait "$BUSY_PID" 2>/dev/null
  log "busy load stopped; its rates: $(grep busy: "$W/busy.log" | tr '\n' ' ')"
  BUSY_PID=""
}
trap '[ -n "$BUSY_PID" ] && kill $BUSY_PID 2>/dev/null' EXIT

log "phase 1: GPU idle"
bench idle.txt "default ngl (none given), idle"
bench idle.txt "ngl 99, idle, run 1" -ngl 99
bench cpu.txt  "ngl 0, idle, run 1" -ngl 0
bench cpu.txt  "ngl 0 --no-op-offload, idle, run 1" -ngl 0 --no-op-offload
summary

log "phase 2: GPU busy"
busy_start
bench busy.txt "ngl 99, busy, run 1" -ngl 99
bench cpu.txt  "ngl 0, busy, run 1" -ngl 0
bench cpu.txt  "ngl 0 --no-op-offload, busy, run 1" -ngl 0 --no-op-offload
bench busy.txt "ngl 99, busy, run 2" -ngl 99
busy_stop
summary

log "phase 3: GPU idle again"
bench idle.txt "ngl 99, idle, run 2" -ngl 99
bench cpu.txt  "ngl 0 --no-op-offload, idle, run 2" -ngl 0 --no-op-offload
bench cpu.txt  "ngl 0, idle, run 2" -ngl 0
summary
cat "$OUT/summary.txt"
log "done"
