"""A stand-in for llama_cpp's C API: enough for LlamaCppBackend.__init__ to load and
size a context (it cannot decode). Put in ``sys.modules["llama_cpp"]``."""

from types import SimpleNamespace


class FakeLlamaCpp:
    """Just enough of llama_cpp's C API for LlamaCppBackend.__init__; records the params."""

    def __init__(self):
        self.model_params = self.context_params = None

    def llama_log_callback(self, fn):
        return fn

    def llama_log_set(self, *a):
        pass

    def llama_backend_init(self):
        pass

    def llama_model_default_params(self):
        return SimpleNamespace(n_gpu_layers=999, vocab_only=False)  # a GPU build's default

    def llama_model_load_from_file(self, path, params):
        self.model_params = params
        return object()

    def llama_model_get_vocab(self, model):
        return object()

    def llama_vocab_n_tokens(self, vocab):
        return 8

    def llama_model_n_ctx_train(self, model):
        return 8192

    def llama_context_default_params(self):
        return SimpleNamespace(op_offload=True)  # llama.cpp's default

    def llama_init_from_model(self, model, params):
        self.context_params = params
        return object()

    def llama_get_memory(self, ctx):
        return object()

    def llama_batch_init(self, *a):
        return object()

    def llama_batch_free(self, *a):
        pass

    def llama_free(self, *a):
        pass

    def llama_model_free(self, *a):
        pass
