# Sourced by the device scripts gpu_cuda_draft.sh and gpu_target_beside_draft.sh:
# the log, the trimmed llama.cpp of .cuda/ unpacked and built, and the random-weight
# draft made from the skeleton (while the build runs) and quantised to Q8_0.
# The caller sets OUT, W (an empty work folder) and REPO; this sets LOG, log(),
# BIN (the built tools) and MODEL (the draft).

LOG=$OUT/log.txt
T0=$(date +%s)
log() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

unpack_and_start_draft() {  # untar llama.cpp; the f16 draft is made in the background
  tar xzf .cuda/llama.cpp.tar.gz -C "$W" || { log "untar failed"; exit 1; }
  log "untarred"
  ( PYTHONPATH="$REPO/.cuda/py:$REPO" python3 -c "
import time; t=time.time()
from benchmarks.gpu_host import draft_from_skeleton
draft_from_skeleton('.cuda/skel.json.gz', '$W/draft-f16.gguf')
print('draft f16 made in %.1f s' % (time.time()-t))" ) >> "$LOG" 2>&1 &
  DRAFT_PID=$!
}

build_llama() {  # SECONDS [cmake flags...]: llama-batched-bench and llama-quantize
  local limit=$1 b=$W/build gen="-G Ninja" tb rc
  shift
  command -v ninja >/dev/null || gen=""
  log "configure start"
  cmake -S "$W/llama.cpp" -B "$b" $gen "$@" -DGGML_NATIVE=ON -DGGML_CCACHE=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DCMAKE_BUILD_TYPE=Release \
    > "$OUT/build.txt" 2>&1 || { log "configure failed"; tail -30 "$OUT/build.txt"; exit 1; }
  log "build start"
  tb=$(date +%s)
  timeout "$limit" cmake --build "$b" -j16 --target llama-batched-bench llama-quantize \
    >> "$OUT/build.txt" 2>&1
  rc=$?
  log "build end rc=$rc after $(( $(date +%s) - tb )) s"
  grep -E '^\[[0-9]+/[0-9]+\]' "$OUT/build.txt" | tail -2 | tee -a "$LOG"
  BIN=$b/bin
  [ -x "$BIN/llama-batched-bench" ] || { log "no llama-batched-bench"; tail -40 "$OUT/build.txt"; exit 1; }
}

quantize_draft() {  # after build_llama: MODEL is the Q8_0 draft (the f16 one if that fails)
  wait "$DRAFT_PID"
  MODEL=$W/draft-q8_0.gguf
  if [ -x "$BIN/llama-quantize" ]; then
    "$BIN/llama-quantize" "$W/draft-f16.gguf" "$MODEL" Q8_0 8 > "$W/quantize.txt" 2>&1 \
      || { tail -20 "$W/quantize.txt" >> "$LOG"; MODEL=$W/draft-f16.gguf; }
  else
    MODEL=$W/draft-f16.gguf
  fi
  log "model: $MODEL ($(du -m "$MODEL" | cut -f1) MB)"
}
