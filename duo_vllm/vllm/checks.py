"""Start-up checks, first thing in ``DuoProposer.__init__`` on every rank: a warning for an
untested vLLM, and :class:`UnsupportedVllmError` (vLLM's start-up stops, saying what to
change) off vLLM's V1 model runner, the one that runs custom proposers."""

from __future__ import annotations

import re
import sys

from duo_vllm.logs import vllm_logger

logger = vllm_logger(__name__)

SUPPORTED_VLLM = ((0, 32), (0, 33))  # (major, minor); setup.py's "gpu" extra pins the same
V1_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's switch between its model runners


class UnsupportedVllmError(RuntimeError):
    """This vLLM cannot run DuoProposer; the message says what to change."""


def supported_text() -> str:
    return " and ".join(f"{a}.{b}" for a, b in SUPPORTED_VLLM)


def qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def gpu_model_runner():
    """vLLM's V1 ``GPUModelRunner`` (the CPU runner subclasses it), or None."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return None
    return GPUModelRunner


def vllm_release(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string ("0.32.0+cpu" -> (0, 32)); None if unparsable."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_vllm_version(version: str | None) -> bool:
    """True for a supported vLLM version; otherwise a warning, and False."""
    if vllm_release(version) in SUPPORTED_VLLM:
        return True
    logger.warning(
        "duo_vllm: vLLM %s is untested; duo_vllm supports vLLM %s (pip install "
        "'duo_vllm[gpu]' installs one). It uses private vLLM APIs that may have changed: "
        "check the start-up log for duo_vllm warnings", version, supported_text())
    return False


def constructing_runner(max_depth: int = 16):
    """The ``*ModelRunner`` bound to ``self`` in a calling frame, else None: vLLM builds the
    custom proposer in its runner's constructor."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if obj is not None and type(obj).__name__.endswith("ModelRunner"):
            return obj
        frame = frame.f_back
    return None


def _v2_message(what: str, fix: str = "") -> str:
    fix = fix or (f"unset {V2_ENV} or set {V2_ENV}=0 (vLLM then picks V1 for custom "
                  f"proposers by itself)")
    return (f"DuoProposer needs vLLM's V1 model runner ({V1_RUNNER}), but {what}. vLLM's "
            f"Model Runner V2 does not run custom proposers. Fix: {fix}")


def check_model_runner(runner=None, use_v2: bool | None = None) -> None:
    """Raise :class:`UnsupportedVllmError` unless ``runner`` (None: unknown) is V1's
    ``GPUModelRunner`` or a subclass, with ``_update_states``, and ``use_v2`` is not set."""
    if use_v2:
        raise UnsupportedVllmError(_v2_message("vLLM's config selects Model Runner V2"))
    GPUModelRunner = gpu_model_runner()  # noqa: N806 (vLLM's class)
    if GPUModelRunner is None:
        raise UnsupportedVllmError(f"DuoProposer needs vLLM's V1 model runner ({V1_RUNNER}), "
                                   f"which this vLLM does not have. duo_vllm supports vLLM "
                                   f"{supported_text()}")
    if not callable(getattr(GPUModelRunner, "_update_states", None)):
        raise UnsupportedVllmError(
            f"DuoProposer needs {V1_RUNNER}._update_states, which this vLLM does not "
            f"have. duo_vllm supports vLLM {supported_text()}")
    if runner is None or isinstance(runner, GPUModelRunner):
        return
    cls = type(runner)
    if ".v1.worker.gpu." in f"{cls.__module__}." or ".v1.worker.cpu." in f"{cls.__module__}.":
        raise UnsupportedVllmError(_v2_message(f"this worker runs {qualname(cls)}"))
    raise UnsupportedVllmError(
        f"DuoProposer needs vLLM's V1 model runner ({V1_RUNNER} or a subclass, such as "
        f"the CPU runner), but this worker runs {qualname(cls)}. duo_vllm supports "
        f"vLLM {supported_text()} on CUDA and CPU")


def check_vllm(vllm_config) -> None:
    """The start-up checks (module docstring); a config not of vLLM's own class (a test's)
    is not checked."""
    if not type(vllm_config).__module__.startswith("vllm."):
        return
    import vllm

    check_vllm_version(getattr(vllm, "__version__", None))
    try:
        use_v2 = vllm_config.use_v2_model_runner is True
    except AttributeError:  # a vLLM without the switch
        use_v2 = None
    forced = v2_forced_by(vllm_config)
    if use_v2 and forced:
        raise UnsupportedVllmError(_v2_message(
            f"vLLM runs Model Runner V2 whenever {forced} is set, whatever {V2_ENV} says",
            f"remove {forced}, or serve without DuoProposer"))
    check_model_runner(constructing_runner(), use_v2)


def v2_forced_by(vllm_config) -> str | None:
    """What makes vLLM 0.33 run Model Runner V2 whatever ``V2_ENV`` says (a HiSparse or
    a watermark config), or None."""
    if getattr(getattr(vllm_config, "attention_config", None), "hisparse_config", None):
        return "a HiSparse config (attention_config.hisparse_config)"
    if getattr(vllm_config, "watermark_config", None) is not None:
        return "a watermark config (watermark_config)"
    return None
