"""The re-quantised copies of the packaged Q4_1 draft that sweep.sh measures (a probe, run once).

    python benchmarks/results/quant-sweep-intel/make_copies.py OUT_DIR

SmolLM2's head is its token embedding (tied), so ``output_tensor_type`` sets
the head; Q5_0/Q5_1 put it at Q6_K, which falls back to Q8_0 (576 columns).
q8_0 and q4_0 come from ``draft_quant`` (duo_vllm.models.prepare_draft).
"""
import os
import sys

import llama_cpp

from duo_vllm.models import default_draft_gguf

F = lambda n: getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + n)  # noqa: E731
T = lambda n: getattr(llama_cpp, "GGML_TYPE_" + n)  # noqa: E731
JOBS = {"q5_0": (F("Q5_0"), None), "q5_1": (F("Q5_1"), None),
        "q8h4": (F("Q8_0"), T("Q4_0")), "q8hnl": (F("Q8_0"), T("IQ4_NL")),
        "q8h41": (F("Q8_0"), T("Q4_1"))}

if __name__ == "__main__":
    out, src = sys.argv[1], default_draft_gguf()
    os.makedirs(out, exist_ok=True)
    for name, (ftype, head) in JOBS.items():
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype, p.allow_requantize, p.nthread = ftype, True, 2
        if head is not None:
            p.output_tensor_type = p.token_embedding_type = head
        rc = llama_cpp.llama_model_quantize(src.encode(), os.path.join(out, name + ".gguf").encode(), p)
        print(name, rc)
