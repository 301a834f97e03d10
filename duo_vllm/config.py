"""DuoProposer configuration: one dataclass, validated once at start-up. vLLM's
``SpeculativeConfig`` rejects unknown keys, so the options travel in the one dict a custom
proposer leaves free, ``draft_load_config.model_loader_extra_config["duo"]``, or in
``$DUO_VLLM_CONFIG`` (JSON, or ``@/path/to.json``); the speculative config's keys win."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from duo_vllm.draft.backend import QUANT_FTYPES
from duo_vllm.host.cores import (CoreChoice, Topology, cgroup_cpu_limit, choose_draft_cores,
                                 draft_threads, gpu_numa_node, parse_cpu_list, read_topology)
from duo_vllm.logs import vllm_logger

ENV_VAR = "DUO_VLLM_CONFIG"
EXTRA_CONFIG_KEY = "duo"
INTERNAL_OPTIONS = frozenset({"vllm_limits"})  # set by DuoProposer, never by users
_VLLM_LIMIT_KEYS = ("given", "max_model_len", "max_num_seqs", "vocab_size")

DEFAULT_N_CTX = 2048  # n_ctx where neither the user nor vLLM says (DraftWorker on its own)
DEFAULT_MAX_SEQUENCES = 8  # the fewest requests the draft keeps unless the user says
MAX_DEFAULT_SEQUENCES = 16  # the most unless the user says (idle slots' KV costs tokens)
LLAMA_MAX_SEQ = 256  # llama.cpp's sequences a context holds; a draft branch is a sequence
DRAFT_KV_TOKENS = 65536  # KV cells (max_sequences * n_ctx) the derived defaults may allocate


class DuoConfigError(ValueError):
    """A DuoProposer setting is wrong; the message says which and how to fix it."""


# the options a user sets (each in the README), and the benchmark and ablation switches
USER_OPTIONS = ("draft_model", "draft_quant", "draft_cores", "draft_window", "n_ctx",
                "max_sequences", "max_batch", "lookup", "draft_seeded", "draft_gpu_layers",
                "ray_address", "resources")
TUNING_OPTIONS = ("n_threads", "max_draft_len", "use_actor", "actor_name", "namespace",
                  "prompt_cache_mb", "propose_timeout_s", "max_restarts", "parallel",
                  "multi_sequence", "budget", "max_branches", "gate", "lend_cores",
                  "sampled_drafts")


def _is_int(value, low: int, high: int | None = None) -> bool:
    """Is ``value`` an integer (not a bool) from ``low`` to ``high`` (``None``: no bound)?"""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low \
        and (high is None or value <= high)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value, low: int, high: int | None = None, note: str = "") -> None:
    if not _is_int(value, low, high):
        bound = f">= {low}" if high is None else f"from {low} to {high}"
        raise DuoConfigError(f"{name} must be an integer {bound}{note}, got {value!r}")


@dataclass(frozen=True)
class DuoConfig:
    """Options of :class:`duo_vllm.DuoProposer`: :data:`USER_OPTIONS` (README.md,
    "Options"); :data:`TUNING_OPTIONS` under ``{"tuning": {...}}``, for benchmarks and
    ablations; ``vllm_limits``, set by DuoProposer (:meth:`follow_vllm`)."""

    draft_model: str | None = None
    draft_quant: str = "auto"
    draft_cores: tuple[int, ...] | None = None
    draft_window: int | None = 256
    n_ctx: int = 2048
    max_sequences: int = 8
    max_batch: int | None = None
    lookup: bool = True
    lookup_only: bool = False  # the user's lookup: "only"
    draft_seeded: bool = False
    draft_gpu_layers: int = 0
    ray_address: str | None = None
    resources: dict[str, float] | None = None
    # tuning
    n_threads: int | None = None
    max_draft_len: int | None = None
    use_actor: bool = True
    actor_name: str = "duo_vllm_draft"
    namespace: str = "duo_vllm"
    prompt_cache_mb: int = 256
    propose_timeout_s: float | str = "auto"
    max_restarts: int = 3
    parallel: bool = True
    multi_sequence: bool = True
    budget: str | int = "auto"
    max_branches: int = 4
    gate: bool = True
    lend_cores: bool = True
    sampled_drafts: bool = True
    vllm_limits: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        cores = self.draft_cores
        if cores is not None:
            if hasattr(cores, "__iter__") and not isinstance(cores, (str, bytes)):
                cores = tuple(cores)
            if not isinstance(cores, tuple) or not cores or not all(_is_int(c, 0) for c in cores):
                raise DuoConfigError(f"draft_cores must be a non-empty list of CPU ids >= 0, "
                                     f"got {self.draft_cores!r}")
            object.__setattr__(self, "draft_cores", cores)
        for name in ("n_threads", "max_draft_len", "max_batch"):  # None: unset
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        for name in ("n_ctx", "max_sequences"):
            _check_int(name, getattr(self, name), 1)
        w = self.draft_window
        if w is not None:  # 0, or at least 16 tokens
            _check_int("draft_window", w, 0 if w == 0 else 16, note=" (0: the whole context)")
        _check_int("prompt_cache_mb", self.prompt_cache_mb, 0, note=" (MiB; 0: no prompt cache)")
        _check_int("max_restarts", self.max_restarts, 0)
        _check_int("max_branches", self.max_branches, 1, 8)
        _check_int("draft_gpu_layers", self.draft_gpu_layers, -1,
                   note=" (0: CPU only, -1: all layers on a GPU)")
        if self.budget != "auto":
            _check_int("budget", self.budget, 0, note=' (tokens per request per step) or "auto"')
        t = self.propose_timeout_s
        if t != "auto" and not (_is_number(t) and t > 0):
            raise DuoConfigError(f'propose_timeout_s must be "auto" or a number of seconds > 0, '
                                 f"got {t!r}")
        for name in ("use_actor", "parallel", "multi_sequence", "gate", "lookup",
                     "lookup_only", "lend_cores", "sampled_drafts", "draft_seeded"):
            if not isinstance(getattr(self, name), bool):
                raise DuoConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.lookup_only and not self.lookup:
            raise DuoConfigError('lookup "only" needs lookup drafts (with lookups and the '
                                 "model off nothing is drafted: leave out speculative_config "
                                 "for plain decoding)")
        r = self.resources
        if r is not None and not (isinstance(r, dict) and all(
                isinstance(k, str) and _is_number(v) and v > 0 for k, v in r.items())):
            raise DuoConfigError('resources must map Ray resource names to amounts > 0, '
                                 f'e.g. {{"duo_draft": 1}}; got {r!r}')
        quants = ("auto", "keep", *QUANT_FTYPES)
        if self.draft_quant not in quants:
            raise DuoConfigError(f"draft_quant must be one of {list(quants)}, "
                                 f"got {self.draft_quant!r}")
        if self.draft_model is not None and not isinstance(self.draft_model, str):
            raise DuoConfigError(f"draft_model must be a path string, got {self.draft_model!r}")
        v = self.vllm_limits
        if v is not None and not (isinstance(v, dict) and set(v) == set(_VLLM_LIMIT_KEYS)):
            raise DuoConfigError(f"vllm_limits is set by DuoProposer (keys {_VLLM_LIMIT_KEYS}), "
                                 f"got {v!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any], internal: bool = True) -> "DuoConfig":
        """The config of the user's options, a ``tuning`` mapping and (``internal``: where
        DuoProposer wrote them, not the user) ``vllm_limits``."""
        if not isinstance(data, dict):
            raise DuoConfigError(f"DuoProposer config must be a JSON object, "
                                 f"got {type(data).__name__}")
        known = set(USER_OPTIONS) | {"tuning"} | (INTERNAL_OPTIONS if internal else set())
        unknown = sorted(set(data) - known)
        if unknown:
            hint = sorted(set(unknown) & set(TUNING_OPTIONS))
            raise DuoConfigError(
                f"unknown DuoProposer option(s) {unknown}; valid options are "
                f"{sorted(USER_OPTIONS)}" + (f" ({hint} go under \"tuning\")" if hint else ""))
        tuning = data.get("tuning") or {}
        if not isinstance(tuning, dict) or set(tuning) - set(TUNING_OPTIONS):
            bad = sorted(set(tuning) - set(TUNING_OPTIONS)) if isinstance(tuning, dict) \
                else tuning
            raise DuoConfigError(f"unknown tuning option(s) {bad!r}; tuning options are "
                                 f"{sorted(TUNING_OPTIONS)}")
        fields = {k: v for k, v in data.items() if k != "tuning"}
        if fields.get("lookup") == "only":
            fields.update(lookup=True, lookup_only=True)
        elif "lookup" in fields and not isinstance(fields["lookup"], bool):
            raise DuoConfigError(f'lookup must be true, false or "only", got {fields["lookup"]!r}')
        cfg = cls(**fields, **tuning)
        object.__setattr__(cfg, "_given", frozenset(data))  # what follow_vllm must not change
        return cfg

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
                    f"must be a JSON object, got {type(section).__name__}")
            if isinstance(merged.get("tuning"), dict) and isinstance(section.get("tuning"), dict):
                # tuning switches merge key by key, as options do
                section = {**section, "tuning": {**merged["tuning"], **section["tuning"]}}
            merged.update(section)
        return cls.from_dict(merged, internal=False)

    def follow_vllm(self, vllm_config) -> "DuoConfig":
        """This config with vLLM's limits and which of n_ctx/max_sequences the user set: the
        actor derives the others once it knows the draft's training context."""
        sched = getattr(vllm_config, "scheduler_config", None)
        model = getattr(vllm_config, "model_config", None)

        def positive(value):
            return value if _is_int(value, 1) else None
        try:
            vocab = model.get_vocab_size()
        except Exception:  # no model config (tests), or one that cannot say
            vocab = None
        given = getattr(self, "_given", None)
        if given is None:  # built in code, not from options: what differs from the default
            defaults = DuoConfig()
            given = {n for n in ("n_ctx", "max_sequences")
                     if getattr(self, n) != getattr(defaults, n)}
        return dataclasses.replace(self, vllm_limits={
            "max_num_seqs": positive(getattr(sched, "max_num_seqs", None)),
            "max_model_len": positive(getattr(model, "max_model_len", None)),
            "vocab_size": positive(vocab),
            "given": sorted(n for n in ("n_ctx", "max_sequences") if n in given)})

    def target_vocab_size(self) -> int | None:
        """The target's vocabulary size (its logits' width), where vLLM's is attached."""
        return (self.vllm_limits or {}).get("vocab_size")

    def draft_limits(self, n_ctx_train: int | None, max_branches: int) -> "DraftLimits":
        """n_ctx and max_sequences for a draft model trained on ``n_ctx_train`` tokens."""
        v = self.vllm_limits or {"max_num_seqs": None, "max_model_len": None,
                                 "given": ["n_ctx", "max_sequences"]}
        user = {n: getattr(self, n) for n in v["given"]}
        return derive_draft_limits(v["max_num_seqs"], v["max_model_len"], n_ctx_train, user,
                                   max_branches)

    def fixed_budget(self) -> int | None:
        """The fixed per-request budget, or ``None`` for ``"auto"``."""
        return None if self.budget == "auto" else int(self.budget)

    def to_dict(self) -> dict[str, Any]:
        """The options as :meth:`from_dict` reads them (the actor's copy)."""
        data = dataclasses.asdict(self)
        if self.draft_cores is not None:
            data["draft_cores"] = list(self.draft_cores)
        if data.pop("lookup_only"):
            data["lookup"] = "only"
        out = {k: data[k] for k in USER_OPTIONS}
        out["tuning"] = {k: data[k] for k in TUNING_OPTIONS}
        if self.vllm_limits is not None:
            out["vllm_limits"] = self.vllm_limits
        return out


def nest_tuning(flat: dict[str, Any]) -> dict[str, Any]:
    """Flat options (tuning switches beside user options, ``lookup_only``) nested as
    :meth:`DuoConfig.from_dict` reads them: for benchmarks and tests."""
    out = {k: v for k, v in flat.items() if k not in TUNING_OPTIONS and k != "lookup_only"}
    tuning = {**flat.get("tuning", {}), **{k: flat[k] for k in TUNING_OPTIONS if k in flat}}
    if flat.get("lookup_only"):
        out["lookup"] = "only"
    if tuning:
        out["tuning"] = tuning
    return out


@dataclass(frozen=True)
class DraftLimits:
    """The draft's context per request and number of requests, and why not more."""

    n_ctx: int
    max_sequences: int
    warnings: tuple[str, ...] = ()  # what the user's or vLLM's values cannot have
    notes: tuple[str, ...] = ()  # defaults that stop short of vLLM's (logged as info)


def derive_draft_limits(max_num_seqs: int | None, max_model_len: int | None,
                        n_ctx_train: int | None, user: dict[str, int],
                        max_branches: int = 4) -> DraftLimits:
    """The draft's n_ctx and max_sequences: the user's (``user``), bounded, else derived
    from vLLM's limits (``None``: unknown; ``n_ctx_train`` 0: unknown).

    n_ctx follows ``max_model_len``, at most the draft's training context (a user's value
    too) and ``DRAFT_KV_TOKENS / 8``. max_sequences follows ``max_num_seqs``, at least 8 (a
    spare slot lets a new prompt prefill before the request it replaces frees its own), at
    most ``MAX_DEFAULT_SEQUENCES``, ``DRAFT_KV_TOKENS // n_ctx`` and ``LLAMA_MAX_SEQ //
    max_branches`` (a user's value too).
    """
    warnings, notes = [], []
    train = n_ctx_train if n_ctx_train and n_ctx_train > 0 else None
    if "n_ctx" in user:
        n_ctx = int(user["n_ctx"])
        if train and n_ctx > train:
            warnings.append(f"n_ctx {n_ctx} is above the draft model's training context "
                            f"({train} tokens); using {train}. Fix: set the option n_ctx to "
                            f"at most {train}")
            n_ctx = train
    else:
        n_ctx = max_model_len or DEFAULT_N_CTX
        bounds = [(DRAFT_KV_TOKENS // DEFAULT_MAX_SEQUENCES,
                   f"the draft's KV cache bound ({DRAFT_KV_TOKENS} tokens for at least "
                   f"{DEFAULT_MAX_SEQUENCES} requests)")]
        if train:
            bounds.append((train, f"the draft model's training context ({train} tokens)"))
        bound, why = min(bounds)
        if n_ctx > bound:
            if max_model_len:
                warnings.append(
                    f"vLLM's max_model_len {max_model_len} is above {why}: the draft reads "
                    f"requests of up to {bound} tokens (n_ctx {bound}); longer ones get no "
                    f"drafts from the draft model (lookup drafts still). The option n_ctx "
                    f"sets it" + ("" if train and bound == train else
                                  " (the KV cache holds max_sequences x n_ctx tokens)"))
            n_ctx = bound
    seq_cap = max(1, LLAMA_MAX_SEQ // max(1, max_branches))
    if "max_sequences" in user:
        rows = int(user["max_sequences"])
        if rows > seq_cap:
            warnings.append(f"max_sequences {rows} with max_branches {max_branches} needs "
                            f"{rows * max_branches} llama.cpp sequences, more than its "
                            f"{LLAMA_MAX_SEQ}; using {seq_cap}. Fix: set max_sequences to at "
                            f"most {seq_cap}, or lower max_branches")
            rows = seq_cap
    else:
        kv_cap = max(1, DRAFT_KV_TOKENS // n_ctx)
        bounds = [(seq_cap, f"llama.cpp's {LLAMA_MAX_SEQ} sequences over {max_branches} "
                            "branches"),
                  (kv_cap, f"the draft's KV cache bound, {DRAFT_KV_TOKENS} tokens at n_ctx "
                           f"{n_ctx}"),
                  (MAX_DEFAULT_SEQUENCES, "the default's cap: idle slots keep KV cells that "
                                          "slow every draft token")]
        bound, why = min(bounds)
        rows = min(max(DEFAULT_MAX_SEQUENCES, max_num_seqs or 0), bound)
        if max_num_seqs and rows < max_num_seqs:
            notes.append(f"the draft keeps {rows} of vLLM's max_num_seqs {max_num_seqs} "
                         f"requests ({why}): with more running, the least recently drafted "
                         f"get lookup drafts only. The option max_sequences sets it (the KV "
                         f"cache holds max_sequences x n_ctx tokens)")
    return DraftLimits(n_ctx, rows, tuple(warnings), tuple(notes))


RAY_EXTRA_ENV = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"


def forward_to_ray_workers(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``DUO_VLLM_CONFIG``, when set, added to ``RAY_EXTRA_ENV``: vLLM's Ray
    workers copy only the variables it names (besides vLLM's own)."""
    if not env.get(ENV_VAR):
        return env
    names = [n.strip() for n in env.get(RAY_EXTRA_ENV, "").split(",") if n.strip()]
    if ENV_VAR in names:
        return env
    return {**env, RAY_EXTRA_ENV: ",".join(names + [ENV_VAR])}


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
        raise DuoConfigError(f"{source} is not valid JSON ({e.msg} at line {e.lineno} column "
                             f"{e.colno}): {text[:200]!r}") from e
    if not isinstance(data, dict):
        raise DuoConfigError(f"{source} must be a JSON object, got {type(data).__name__}")
    return data


def target_cores(environ: dict[str, str] | None = None) -> list[int] | None:
    """Cores vLLM's CPU worker binds its OpenMP threads to (``OMP_PLACES``, libgomp's or
    Intel's affinity, else ``VLLM_CPU_OMP_THREADS_BIND``), or ``None`` (GPU vLLM)."""
    from duo_vllm.host.lending import bind_order

    environ = os.environ if environ is None else environ
    bind = environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    places = environ.get("OMP_PLACES", "")
    if places.startswith("{") and "|" not in bind:
        try:
            return parse_cpu_list(places)
        except ValueError:
            pass
    order = bind_order(environ) if "|" not in bind else None
    if order:  # auto binding, as libgomp or Intel OpenMP got it inside the worker
        return sorted(set(order))
    if bind not in ("auto", "nobind", "all"):
        try:
            return sorted({c for part in bind.split("|") for c in parse_cpu_list(part)})
        except ValueError:
            return None
    return None


_CPUSET_FILES = ("/sys/fs/cgroup/cpuset.cpus.effective",  # cgroup v2
                 "/sys/fs/cgroup/cpuset/cpuset.effective_cpus")  # cgroup v1


def allowed_cpus() -> list[int]:
    """CPUs this container may use: its cpuset (in vLLM's CPU worker
    ``os.sched_getaffinity(0)`` is already bound to the target's cores)."""
    for path in _CPUSET_FILES:
        try:
            with open(path, encoding="ascii") as f:
                cpus = parse_cpu_list(f.read().strip())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class HostFacts:
    """What the core choice reads from the host (tests build their own)."""

    topology: Topology
    quota: int | None  # the cgroup's CPU quota, in CPUs (None: no quota)
    gpu_node: int | None  # the NUMA node of vLLM's GPU (None: unknown, or no GPU)


def read_host(cpus: list[int], gpu: bool = True) -> HostFacts:
    """The host's topology, CPU quota and (with ``gpu``) the GPU's NUMA node."""
    return HostFacts(read_topology(cpus), cgroup_cpu_limit(), gpu_numa_node() if gpu else None)


def choose_cores(cfg: DuoConfig, available: list[int], environ: dict[str, str],
                 host: HostFacts) -> CoreChoice:
    """The draft's cores: ``draft_cores`` as given (checked), else the host's choice."""
    available = sorted(available)
    taken = target_cores(environ)
    if cfg.draft_cores is not None:
        missing = [c for c in cfg.draft_cores if c not in available]
        if missing:
            raise DuoConfigError(f"draft_cores {list(cfg.draft_cores)} name CPU(s) {missing} that "
                                 f"do not exist or are not allowed for this process; "
                                 f"available CPUs: {available}")
        shared = bool(taken) and bool(set(cfg.draft_cores) & set(taken))
        return CoreChoice(list(cfg.draft_cores), shared, "the draft_cores option")
    return choose_draft_cores(available, taken, host.topology, host.quota, host.gpu_node)


def resolve_draft_cores(cfg: DuoConfig, available: list[int] | None = None,
                        environ: dict[str, str] | None = None,
                        host: HostFacts | None = None) -> tuple[list[int], bool]:
    """``(cores, shared_with_target)``: the draft cores validated or chosen, and logged."""
    available = sorted(allowed_cpus() if available is None else available)
    environ = os.environ if environ is None else environ
    if host is None and cfg.draft_cores is None:
        host = read_host(available)
    choice = choose_cores(cfg, available, environ, host or HostFacts(Topology({}, {}), None, None))
    threads, _ = draft_threads(cfg.n_threads, len(choice.cores))
    vllm_logger("duo_vllm.config").info("DuoProposer: draft cores %s, %d llama.cpp thread(s): %s",
                                        choice.cores, threads, choice.reason)
    return choice.cores, choice.shared

