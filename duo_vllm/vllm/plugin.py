"""vLLM's general-plugin entry point (``vllm.general_plugins`` in setup.py).

vLLM loads it in each of its processes, the engine core included, which
DuoProposer (in the worker) cannot reach. It installs what must run there
and nothing else; each piece does nothing unless a DuoProposer is in use.
"""

from __future__ import annotations

from duo_vllm.logs import vllm_logger

logger = vllm_logger(__name__)


def register() -> None:
    """The engine core takes the step's drafts from its output (duo_vllm/vllm/drafts_out.py)."""
    try:
        from duo_vllm.vllm.drafts_out import install_drafts_from_output

        install_drafts_from_output()
    except Exception as e:  # another vLLM: its own call to the worker stays, only slower
        logger.debug("duo_vllm: drafts from the step's output not installed (%s: %s)",
                     type(e).__name__, e)
