"""The draft file type: which drafts are re-quantised, and the cached copy llama.cpp loads."""

import os

import numpy as np
import pytest

from benchmarks.profile_draft import greedy_picks
from duo_vllm.draft.backend import gguf_file_type
from duo_vllm.models import default_draft_gguf, draft_quant_target, prepare_draft


def test_auto_requantises_q4_1_only():
    assert draft_quant_target("LLAMA_FTYPE_MOSTLY_Q4_1", "auto") == "q8_0"
    assert draft_quant_target("LLAMA_FTYPE_MOSTLY_Q8_0", "auto") is None
    assert draft_quant_target("LLAMA_FTYPE_MOSTLY_Q4_K_M", "auto") is None
    assert draft_quant_target(None, "auto") is None
    assert draft_quant_target("LLAMA_FTYPE_MOSTLY_Q4_1", "keep") is None
    assert draft_quant_target("LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0") == "q4_0"


def test_keep_loads_the_file_itself(tmp_path):
    src = default_draft_gguf()
    assert prepare_draft(src, "keep", root=tmp_path) == src
    assert not (tmp_path / "drafts").exists()


def test_default_draft_is_requantised_once_and_keeps_its_greedy_tokens(tmp_path):
    src = default_draft_gguf()
    assert gguf_file_type(src) == "LLAMA_FTYPE_MOSTLY_Q4_1"
    logs = []
    out = prepare_draft(src, "auto", root=tmp_path, log=logs.append)
    assert out != src and os.path.isfile(out) and len(logs) == 1
    assert gguf_file_type(out) == "LLAMA_FTYPE_MOSTLY_Q8_0"
    assert [p.name for p in (tmp_path / "drafts").iterdir()] == [os.path.basename(out)]
    mtime = os.path.getmtime(out)
    assert prepare_draft(src, "auto", root=tmp_path, log=logs.append) == out  # cached
    assert len(logs) == 1 and os.path.getmtime(out) == mtime

    # Q8_0 holds Q4_1's values almost exactly: fed the source's greedy chain,
    # the copy picks the same next token at (nearly) every position
    prompt = np.array([1, 9690, 314, 253, 5356, 28, 1812, 30, 2], dtype=np.int32)
    chain = greedy_picks(src, [prompt], 32)
    picks = [chain[0], greedy_picks(out, [prompt], 32, feed=chain)[0]]
    agree = np.mean(np.array(picks[0]) == np.array(picks[1]))
    assert agree >= 0.85, picks


def test_unreadable_draft_is_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="not a valid GGUF"):
        prepare_draft(str(bad), "auto", root=tmp_path)


def test_the_installed_llama_cpp_carries_the_small_batch_patch():
    """scripts/install.sh builds llama.cpp with patches/llama-cpp-sgemm-min-n.patch: draft
    calls of 2-7 sequences run on ggml's own kernels (up to 37% faster here than tinyBLAS;
    benchmarks/README.md). The patch's switch is in the CPU backend it built."""
    import glob
    import platform
    from pathlib import Path

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("llama.cpp's tinyBLAS path (and so the patch) is x86-specific here")
    import llama_cpp

    libs = glob.glob(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "*ggml-cpu*.so*"))
    assert libs, "no ggml CPU backend in the llama_cpp package"
    assert any(b"GGML_SGEMM_MIN_N" in Path(p).read_bytes() for p in libs)
