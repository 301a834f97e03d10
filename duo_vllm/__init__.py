"""duo_vllm: DuoDecoding-style speculative decoding for vLLM, drafting on CPU cores."""

from duo_vllm.config import DuoConfig, DuoConfigError

__all__ = ["DuoProposer", "DuoConfig", "DuoConfigError"]
__version__ = "0.1.0"


def __getattr__(name):
    # vLLM imports "duo_vllm.DuoProposer": the proposer's heavy imports wait until then
    if name == "DuoProposer":
        from duo_vllm.vllm.proposer import DuoProposer

        return DuoProposer
    raise AttributeError(name)
