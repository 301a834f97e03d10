#!/usr/bin/env bash
# Does the CPU draft slow a GPU target's decode loop? (lent GPU machine, device tool)
#
# vLLM's target at small batch is host-bound: one Python thread launches many
# small CUDA kernels and syncs once per step. duo_vllm runs the draft in
# llama.cpp on pinned CPU cores beside it. Earlier runs (gpu_cuda_draft.sh)
# showed a busy GPU does not slow the CPU draft; this measures the reverse.
#
# What runs there:
#   1. llama.cpp (the trimmed tarball) built CPU-only (GGML_NATIVE, Release:
#      llama-batched-bench, llama-quantize), and a random-weight Q8_0 draft of
#      the default draft's shapes (SmolLM2-135M) made from the skeleton.
#   2. a "target": transformers' LlamaForCausalLM with random weights, shapes of
#      SmolLM2-360M (hidden 960, 32 layers, 15 heads, 5 kv heads, intermediate
#      2560, vocab 49152), bf16 on cuda, sdpa attention, greedy decode with a KV
#      cache one token per call, torch.cuda.synchronize() every step; process
#      pinned to CPU 0 (taskset -c 0, torch.set_num_threads(1)). Each cycle:
#      prefill 32 tokens, 8 unmeasured steps (20 in a phase's first cycle),
#      then 128 measured steps, so each phase sees the same context lengths.
#   3. phases, in order:
#        draft-alone   the draft on CPUs 8-15, the target process sleeping
#                      (the draft's own speed, for comparison)
#        a idle / b draft 8-15 / c idle / d draft 1-8 / e idle   (target batch 1)
#        f idle / g draft 8-15 / h draft 1-8 / i idle            (target batch 8,
#                      skipped when time runs short)
#      "draft X-Y" = llama-batched-bench -ngl 0 -t 8 pinned by taskset to those
#      CPUs, -npp 256 -ntg 256 -npl 1,2,4,8, looped (setsid; the process group
#      is killed at the phase's end). A draft phase lasts at least 256 target
#      steps and until the draft finished one whole npl 1..8 sweep (cap 30 s);
#      an idle phase is 256 steps. Cores 1-8 sit next to the target's core 0.
# Output under $OUT (6 files): log.txt (machine, timeline), build.txt,
# target.txt (the target's log), draft.txt (the draft's output by phase),
# summary.txt (per phase: target ms/step median/p90/mean, draft S_TG by width),
# steps.json (every measured step's ms, by phase).
#
# Inputs (git-ignored .cuda/, made on the dev machine, see gpu_cuda_draft.sh):
#   .cuda/llama.cpp.tar.gz, .cuda/skel.json.gz, .cuda/py/gguf
# Run through the device tool (about 4 minutes):
#   run(command="bash benchmarks/gpu_target_beside_draft.sh", carry=[".cuda"], timeout_s=330)

set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-target-out}
mkdir -p "$OUT"
REPO=$PWD
W=/tmp/duo-target
rm -rf "$W" && mkdir -p "$W"
. benchmarks/gpu_draft_setup.sh

log "start"
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  lscpu | head -25; echo "nproc: $(nproc)"; cmake --version | head -1
  python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)'
} >> "$LOG" 2>&1

unpack_and_start_draft
build_llama 150 -DGGML_CUDA=OFF
quantize_draft

cat > "$W/target.py" <<'EOF'
import json, os, re, signal, statistics, subprocess, sys, time
import torch
torch.set_num_threads(1)
from transformers import LlamaConfig, LlamaForCausalLM

OUT, W, BIN, MODEL = (os.environ[k] for k in ("OUT", "W", "BIN", "MODEL"))
T_START = time.time()
BUDGET = float(os.environ.get("BUDGET", "140"))  # s; a B=8 phase is skipped past BUDGET-35
print("affinity:", sorted(os.sched_getaffinity(0)), "torch threads:", torch.get_num_threads())

cfg = LlamaConfig(vocab_size=49152, hidden_size=960, intermediate_size=2560,
                  num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                  max_position_embeddings=8192, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, hidden_act="silu")
cfg._attn_implementation = "sdpa"
t = time.time()
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg)
model = model.to(device="cuda", dtype=torch.bfloat16).eval()
torch.cuda.synchronize()
print("target: %.0f M params, made in %.1f s, attn %s, %s" % (
    sum(p.numel() for p in model.parameters()) / 1e6, time.time() - t,
    getattr(model.config, "_attn_implementation", "?"), torch.cuda.get_device_name()))

gen = torch.Generator(device="cuda").manual_seed(1)

@torch.inference_mode()
def cycle(batch, warm, n):
    """prefill 32 tokens, `warm` unmeasured steps, then n measured steps (ms)"""
    ids = torch.randint(0, 49152, (batch, 32), device="cuda", generator=gen)
    out = model(input_ids=ids, use_cache=True)
    pkv = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    ms = []
    for i in range(warm + n):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        if i >= warm:
            ms.append((time.perf_counter() - t0) * 1e3)
    return ms

def draft_rows(path):
    rows = []
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return rows
    for line in text.splitlines():
        c = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(c) == 10 and c[0].isdigit():
            rows.append(dict(pp=int(c[0]), tg=int(c[1]), b=int(c[2]), t_pp=float(c[4]),
                             s_pp=float(c[5]), t_tg=float(c[6]), s_tg=float(c[7])))
    return rows

def draft_start(name, cpus):
    path = os.path.join(W, "draft_%s.txt" % name)
    cmd = ("while :; do echo '=== run' $(date +%%T.%%N); %s/llama-batched-bench -m %s "
           "-c 4096 -b 2048 -ub 512 -npp 256 -ntg 256 -npl 1,2,4,8 -t 8 -ngl 0; done"
           % (BIN, MODEL))
    fh = open(path, "w")
    p = subprocess.Popen(["taskset", "-c", cpus, "bash", "-c", cmd], stdout=fh,
                         stderr=subprocess.STDOUT, start_new_session=True)
    # wait until its first run has loaded the model and begun the sweep
    t = time.time()
    while time.time() - t < 8:
        if "n_kv_max" in open(path, errors="replace").read():
            break
        time.sleep(0.1)
    return p, fh, path

def draft_stop(p, fh):
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        p.wait(5)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL); p.wait()
    fh.close()

results, steps = [], {}

def phase(name, batch, cpus=None, target=True, min_steps=256, cap=30.0):
    p = fh = path = None
    t0 = time.time()
    if cpus:
        p, fh, path = draft_start(name, cpus)
    ms, first = [], True
    while True:
        if target:
            ms += cycle(batch, 20 if first else 8, 128)
            first = False
        else:
            time.sleep(0.25)
        done_draft = (not cpus) or len(draft_rows(path)) >= 4
        if (len(ms) >= min_steps or not target) and done_draft:
            break
        if time.time() - t0 > cap:
            break
    if p:
        draft_stop(p, fh)
    rows = draft_rows(path)[:4] if path else []
    r = dict(phase=name, batch=batch, draft_cpus=cpus or "-", seconds=round(time.time() - t0, 1),
             n=len(ms), draft=rows)
    if ms:
        s = sorted(ms)
        r.update(median=statistics.median(s), p90=s[int(0.9 * (len(s) - 1))],
                 mean=statistics.fmean(s), min=s[0], max=s[-1])
        steps[name] = [round(x, 3) for x in ms]
    results.append(r)
    line = "%-22s B=%d draft=%-5s %5.1fs n=%4d" % (name, batch, r["draft_cpus"], r["seconds"], r["n"])
    if ms:
        line += "  ms/step median %.3f p90 %.3f mean %.3f min %.3f max %.3f" % (
            r["median"], r["p90"], r["mean"], r["min"], r["max"])
    if rows:
        line += "  draft S_TG " + " ".join("B%d:%.1f" % (x["b"], x["s_tg"]) for x in rows)
    print(line, flush=True)
    write()

def write():
    with open(os.path.join(OUT, "steps.json"), "w") as f:
        json.dump(steps, f)
    with open(os.path.join(OUT, "summary.txt"), "w") as f:
        f.write("target: LlamaForCausalLM 360M-shape random bf16, sdpa, CPU 0; ms per decode step\n")
        f.write("phase                  B  draft  n     median    p90      mean   | draft S_TG t/s by width (ms/step)\n")
        for r in results:
            f.write("%-22s %d  %-5s  %-4d  " % (r["phase"], r["batch"], r["draft_cpus"], r["n"]))
            if r["n"]:
                f.write("%7.3f  %7.3f  %7.3f  " % (r["median"], r["p90"], r["mean"]))
            else:
                f.write("%-27s" % "(target sleeping)")
            f.write("| " + " ".join("B%d %.1f (%.2f)" % (x["b"], x["s_tg"], 1000 * x["b"] / x["s_tg"])
                                   for x in r["draft"]) + "\n")

# warm the target (cuBLAS handles, allocator) before any phase
w = cycle(1, 20, 64) + cycle(8, 20, 64)
print("warm-up done: B1 median %.3f ms" % statistics.median(w[:64]))

phase("0-draft-alone-8-15", 1, "8-15", target=False)
phase("a-idle", 1)
phase("b-draft-8-15", 1, "8-15")
phase("c-idle", 1)
phase("d-draft-1-8", 1, "1-8")
phase("e-idle", 1)
for args in (("f-idle-B8", 8), ("g-draft-8-15-B8", 8, "8-15"),
             ("h-draft-1-8-B8", 8, "1-8"), ("i-idle-B8", 8)):
    if time.time() - T_START > BUDGET - 35:
        print("skipped %s (time)" % args[0])
        continue
    phase(*args)
print("target done in %.0f s" % (time.time() - T_START))
EOF

log "target start"
OUT=$OUT W=$W BIN=$BIN MODEL=$MODEL BUDGET=140 OMP_NUM_THREADS=1 \
  timeout 150 taskset -c 0 python3 "$W/target.py" 2>&1 | tee "$OUT/target.txt"
log "target end rc=$?"
for f in "$W"/draft_*.txt; do
  [ -e "$f" ] || continue
  echo "##### $(basename "$f")"; grep -vE '^(llama_model_loader|print_info|load_tensors|llama_context|llama_kv_cache|load:|llama_model_load|init_tokenizer)' "$f"
done > "$OUT/draft.txt" 2>&1
cat "$OUT/summary.txt" 2>/dev/null | tee -a "$LOG"
log "done"
