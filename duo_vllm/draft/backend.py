"""llama.cpp backend: a GGUF draft model whose KV cache holds many token sequences.

The KV cache is *unified*: a branch forked from a request's sequence (``copy``)
shares its prefix's cells at no cost, as in llama.cpp's parallel-decoding example.
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np

logger = logging.getLogger(__name__)

_LOG_CALLBACK = None  # keep the ctypes callback alive for the process lifetime


def _install_log_filter(llama_cpp) -> None:
    """Route llama.cpp's C log to Python logging, warnings and errors only."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return

    @llama_cpp.llama_log_callback
    def _callback(level, text, _user_data):
        # ggml_log_level: 0 none, 1 debug, 2 info, 3 warn, 4 error, 5 cont
        if level in (3, 4):
            message = text.decode("utf-8", "replace").rstrip()
            if "n_ctx_seq" in message and "n_ctx_train" in message:
                # the unified cache vs n_ctx_train: each request is kept to n_ctx_train
                return
            logger.warning("llama.cpp: %s", message)

    _LOG_CALLBACK = _callback
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))


# llama_ftype names (llama.h) of the types ``requantize`` may write
QUANT_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
                "iq4_nl": "LLAMA_FTYPE_MOSTLY_IQ4_NL", "f16": "LLAMA_FTYPE_MOSTLY_F16"}


def gguf_file_type(model_path: str) -> str | None:
    """The GGUF's ``general.file_type`` as a llama_ftype name (``"LLAMA_FTYPE_MOSTLY_Q4_1"``),
    read by a vocab-only load; ``None`` if the file does not say."""
    import llama_cpp

    _install_log_filter(llama_cpp)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
    if not model:
        raise ValueError(f"llama.cpp could not read {model_path!r}: not a valid GGUF model")
    try:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_model_meta_val_str(model, b"general.file_type", buf, len(buf))
        if n < 0:
            return None
        code = int(buf.value)
    finally:
        llama_cpp.llama_model_free(model)
    names = [k for k in dir(llama_cpp) if k.startswith("LLAMA_FTYPE_")
             and getattr(llama_cpp, k) == code]
    return names[0] if names else f"LLAMA_FTYPE_{code}"


def requantize(src: str, dst: str, quant: str, n_threads: int = 1) -> None:
    """Write ``src`` re-quantised to ``quant`` (a key of ``QUANT_FTYPES``) at ``dst``."""
    import llama_cpp

    _install_log_filter(llama_cpp)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_FTYPES[quant])
    params.allow_requantize = True
    params.nthread = n_threads
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama.cpp could not re-quantise {src!r} to {quant} (code {rc})")


class LlamaCppBackend:
    """A llama.cpp model and context for up to ``n_seq`` sequences, ``n_ctx`` cells in all
    (or ``size(n_ctx_train)`` of them, called once the model is loaded)."""

    def __init__(self, model_path: str, n_ctx: int | None, n_seq: int | None, n_threads: int,
                 n_batch: int = 512, n_gpu_layers: int = 0, size=None):
        import llama_cpp  # imported here: the package must be importable without it

        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"draft model file not found: {model_path}")
        self._lib = llama_cpp
        self.name = os.path.basename(model_path)
        self.n_batch = n_batch
        _install_log_filter(llama_cpp)
        llama_cpp.llama_backend_init()

        mparams = llama_cpp.llama_model_default_params()
        # a GPU build offloads every layer by default: the draft stays on the CPU unless asked
        mparams.n_gpu_layers = 2 ** 31 - 1 if n_gpu_layers < 0 else n_gpu_layers
        self._model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {model_path!r}: not a valid GGUF model "
                             "(corrupt or truncated file?)")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self._model))
        if size is not None:
            n_ctx, n_seq = size(self.n_ctx_train)
        self.n_ctx, self.n_seq = n_ctx, n_seq

        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.kv_unified = True
        cparams.no_perf = True
        if hasattr(cparams, "op_offload"):  # a GPU build would run prefill batches on the
            cparams.op_offload = n_gpu_layers != 0  # GPU even with no layers there
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {model_path!r} "
                               f"(n_ctx={n_ctx}, n_seq={n_seq})")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._logits_t = ctypes.POINTER(ctypes.c_float * self.n_vocab)

    def token_texts(self) -> list[str]:
        lib, vocab = self._lib, self._vocab
        return [lib.llama_vocab_get_text(vocab, i).decode("utf-8", "replace")
                for i in range(self.n_vocab)]

    def remove(self, seq_id: int, p0: int, p1: int = -1) -> None:
        """Drop positions ``[p0, p1)`` (``p1 = -1``: to the end) of a sequence."""
        self._lib.llama_memory_seq_rm(self._mem, seq_id, p0, p1)

    def copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Make ``dst`` share ``src``'s cells at positions ``[p0, p1)`` (no data is copied)."""
        self._lib.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def save(self, seq_id: int) -> bytearray:
        """A sequence's cells (positions, keys, values), for :meth:`restore`."""
        lib = self._lib
        size = int(lib.llama_state_seq_get_size(self._ctx, seq_id))
        if size <= 0:
            return bytearray()
        buf = bytearray(size)
        view = (ctypes.c_uint8 * size).from_buffer(buf)
        n = int(lib.llama_state_seq_get_data(self._ctx, view, size, seq_id))
        del view  # (a bytearray with a view on it cannot be resized)
        if n < size:
            del buf[max(n, 0):]
        return buf

    def restore(self, seq_id: int, state: bytearray) -> bool:
        """Load what :meth:`save` returned into the empty ``seq_id``; False if no room."""
        if not state:
            return False
        if not isinstance(state, bytearray):
            state = bytearray(state)
        buf = (ctypes.c_uint8 * len(state)).from_buffer(state)
        return int(self._lib.llama_state_seq_set_data(self._ctx, buf, len(state), seq_id)) > 0

    def decode(self, items: list[tuple[int, np.ndarray, int]]) -> list[np.ndarray]:
        """Append each item's ``tokens`` to sequence ``seq_id`` from position ``pos``;
        return per item the logits after its last token (those of the final call are
        views of llama.cpp's buffer, valid until the next call)."""
        lib, batch, cap = self._lib, self._batch, self.n_batch
        flat = [(it, j) for it, (_, toks, _) in enumerate(items) for j in range(len(toks))]
        if not flat:
            return []
        out: list[np.ndarray | None] = [None] * len(items)
        for start in range(0, len(flat), cap):
            chunk = flat[start:start + cap]
            owners = []
            for i, (it, j) in enumerate(chunk):
                seq_id, toks, pos = items[it]
                batch.token[i] = int(toks[j])
                batch.pos[i] = pos + j
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq_id
                last = j == len(toks) - 1
                batch.logits[i] = 1 if last else 0
                if last:
                    owners.append((it, i))
            batch.n_tokens = len(chunk)
            rc = lib.llama_decode(self._ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc} "
                                   f"({len(chunk)} tokens; KV cache full?)")
            final = start + cap >= len(flat)
            for it, i in owners:
                ptr = lib.llama_get_logits_ith(self._ctx, i)
                arr = np.frombuffer(ctypes.cast(ptr, self._logits_t).contents, dtype=np.float32)
                out[it] = arr if final else arr.copy()
        return out  # type: ignore[return-value]

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._lib.llama_batch_free(self._batch)
            self._lib.llama_free(self._ctx)
            self._lib.llama_model_free(self._model)
            self._ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass
