"""duo_vllm: DuoDecoding-style speculative decoding for vLLM, drafting on CPU cores."""

from duo_vllm.config import DuoConfig, DuoConfigError

__all__ = ["DuoProposer", "DuoConfig", "DuoConfigError"]
__version__ = "0.1.0"


def __getattr__(name):
    # vLLM imports "duo_vllm.DuoProposer"; keep the light modules importable
    # without numpy-heavy or Ray imports until the proposer is needed.
    if name == "DuoProposer":
        from duo_vllm.vllm.proposer import DuoProposer

        return DuoProposer
    raise AttributeError(name)
