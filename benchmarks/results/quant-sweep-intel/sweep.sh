#!/bin/bash
# The draft's file types on this VM: width-1 call (3 passes, median) and the ceiling replay at that cost.
# run from the repository root with its venv active, after make_copies.py /tmp/quants
Q=${1:-/tmp/quants}
draft() {  # the draft as draft_quant $1 gives it (the packaged file for keep; cached copies)
  python -c "from duo_vllm.models import default_draft_gguf as d, prepare_draft as p; print(p(d(), '$1', log=lambda *_: None))"
}
KEEP=$(draft keep); Q8=$(draft q8_0); Q4=$(draft q4_0)
OUT=${2:-benchmarks/results/quant-sweep-intel/sweep.txt}
{
echo "# $(date -u +%F) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) (family 6 model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')), $(nproc) cores; commit $(git rev-parse --short HEAD)"
echo "# copies of the packaged Q4_1 draft (llama_model_quantize; head = token_embd, tied): q8_0, q4_0 (its head falls back to q8_0), q8_0 layers + q4_0 / iq4_nl / q4_1 head, q5_0 / q5_1 (head q8_0)"
echo "# profile: python -m benchmarks.profile_draft --draft F --quants keep --context 256 --repeats 20 (core 1), 3 passes"
echo "# ceiling: python -m benchmarks.ceiling --results <plain-all, 20 prompts> --t1 0.060 --tl 0.044 --c 0.0015 --prefill-target 0.0015 --window 256 --busy-prefill --best-of-lookups --draft F --d <median call> --prefill-draft <median prefill>"
for spec in "keep:$KEEP" "q8_0:$Q8" "q8_0+head_q4_0:$Q/q8h4.gguf" "q8_0+head_iq4_nl:$Q/q8hnl.gguf" "q8_0+head_q4_1:$Q/q8h41.gguf" "q5_0:$Q/q5_0.gguf" "q5_1:$Q/q5_1.gguf" "q4_0:$Q4"; do
  name=${spec%%:*}; f=${spec#*:}
  calls=(); pre=()
  for i in 1 2 3; do
    o=$(python -m benchmarks.profile_draft --draft $f --quants keep --context 256 --repeats 20 2>&1)
    calls+=($(echo "$o" | awk '$1==1 {print $2}')); pre+=($(echo "$o" | awk '/^prefill/ {print $2}'))
  done
  mc=$(printf "%s\n" "${calls[@]}" | sort -g | sed -n 2p); mp=$(printf "%s\n" "${pre[@]}" | sort -g | sed -n 2p)
  echo
  echo "== $name ($(basename $f), $(stat -c %s $f) bytes): width-1 call ms ${calls[*]} -> median $mc; prefill ms/token ${pre[*]} -> median $mp"
  python -m benchmarks.ceiling --results ${PLAIN:-/tmp/plainrun} --t1 0.060 --tl 0.044 --c 0.0015 --prefill-target 0.0015 --window 256 --busy-prefill --best-of-lookups --draft $f --d $(python -c "print($mc/1000)") --prefill-draft $(python -c "print($mp/1000)") 2>&1 | grep -E "agrees|^lookups |^oracle |^designed  "
done
} > $OUT 2>&1
