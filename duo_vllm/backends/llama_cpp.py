"""llama.cpp backend: a GGUF draft model with one KV sequence per cached request."""

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
            logger.warning("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

    _LOG_CALLBACK = _callback
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))


class LlamaCppBackend:
    """A llama.cpp model and context holding ``n_seq`` independent sequences."""

    def __init__(self, model_path: str, n_ctx_per_seq: int, n_seq: int,
                 n_threads: int, n_batch: int = 512):
        import llama_cpp  # imported here: the package must be importable without it

        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"draft model file not found: {model_path}")
        self._lib = llama_cpp
        self.name = os.path.basename(model_path)
        self.n_batch = n_batch
        _install_log_filter(llama_cpp)
        llama_cpp.llama_backend_init()

        mparams = llama_cpp.llama_model_default_params()
        mparams.use_mmap = True
        self._model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
        if not self._model:
            raise ValueError(
                f"llama.cpp could not load {model_path!r}: not a valid GGUF model "
                "(corrupt or truncated file?)"
            )
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))

        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx_per_seq * n_seq
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.kv_unified = False  # each sequence owns n_ctx_per_seq cells
        cparams.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {model_path!r}")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._logits_t = ctypes.POINTER(ctypes.c_float * self.n_vocab)

    def token_texts(self) -> list[str]:
        lib, vocab = self._lib, self._vocab
        return [lib.llama_vocab_get_text(vocab, i).decode("utf-8", "replace")
                for i in range(self.n_vocab)]

    def truncate(self, seq_id: int, n: int) -> None:
        self._lib.llama_memory_seq_rm(self._mem, seq_id, n, -1)

    def eval(self, seq_id: int, tokens: np.ndarray, pos: int) -> np.ndarray:
        """Evaluate ``tokens`` at positions ``pos...``; return the logits after the last.

        The returned array is a view of llama.cpp's buffer, valid until the
        next call: no vocabulary-sized copy is made.
        """
        lib, batch = self._lib, self._batch
        n = len(tokens)
        if n == 0:
            raise ValueError("eval needs at least one token")
        for start in range(0, n, self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            m = len(chunk)
            for i in range(m):
                batch.token[i] = int(chunk[i])
                batch.pos[i] = pos + start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq_id
                batch.logits[i] = 0
            last_chunk = start + m == n
            batch.logits[m - 1] = 1 if last_chunk else 0
            batch.n_tokens = m
            rc = lib.llama_decode(self._ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc} (sequence {seq_id})")
        ptr = lib.llama_get_logits_ith(self._ctx, -1)
        return np.frombuffer(ctypes.cast(ptr, self._logits_t).contents, dtype=np.float32)

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
