"""The draft's CPU cores: a few physical cores where vLLM leaves room (:func:`choose_draft_cores`,
a pure function of what the readers here take from ``/sys`` through an injectable ``read``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

# Most llama.cpp threads a draft gets by default: a small draft's matrix-vector ops are
# so short that past this, llama.cpp's per-op barrier costs more than another thread saves.
MAX_DRAFT_THREADS = 8

SYS_CPU = "/sys/devices/system/cpu"
SYS_NODE = "/sys/devices/system/node"
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "quota period" or "max period"
CGROUP_V1_QUOTA = "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"  # cgroup v1: -1 is no quota
CGROUP_V1_PERIOD = "/sys/fs/cgroup/cpu/cpu.cfs_period_us"

Reader = Callable[[str], "str | None"]


def read_text(path: str) -> str | None:
    """A small /sys file's stripped text, or ``None`` if it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


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


@dataclass(frozen=True)
class Topology:
    """Which CPUs share a physical core, and which NUMA node each CPU is on."""

    siblings: dict[int, tuple[int, ...]]  # cpu -> the hyperthreads of its core, itself included
    node_of: dict[int, int]  # cpu -> NUMA node

    def core_of(self, cpu: int) -> int:
        """A physical core's name: its lowest-numbered hyperthread."""
        return min(self.siblings.get(cpu, (cpu,)))

    def node(self, cpu: int) -> int:
        return self.node_of.get(cpu, 0)


def _listed(text: str | None) -> list[int]:
    """A CPU list read from /sys; empty where missing or malformed."""
    try:
        return parse_cpu_list(text or "")
    except ValueError:
        return []


def read_topology(cpus: Iterable[int], read: Reader = read_text) -> Topology:
    """The sibling map and NUMA nodes of ``cpus`` (an undescribed CPU: its own core, node 0)."""
    cpus = list(cpus)
    siblings = {}
    for c in cpus:
        listed = _listed(read(f"{SYS_CPU}/cpu{c}/topology/thread_siblings_list"))
        siblings[c] = tuple(sorted(set(listed) | {c}))
    node_of = {}
    for n in _listed(read(f"{SYS_NODE}/online")):
        for c in _listed(read(f"{SYS_NODE}/node{n}/cpulist")):
            node_of.setdefault(c, n)
    return Topology(siblings, {c: node_of.get(c, 0) for c in cpus})


def parse_cpu_max(text: str | None) -> int | None:
    """floor(quota / period), at least 1, of a ``cpu.max`` text; ``None``: no quota."""
    parts = (text or "").split()
    try:  # "max": no quota
        quota = int(parts[0])
        period = int(parts[1]) if len(parts) > 1 else 100000
    except (IndexError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, quota // period)


def cgroup_cpu_limit(read: Reader = read_text) -> int | None:
    """The CPUs' worth of time this container's CPU quota allows (``None``: no quota)."""
    limit = parse_cpu_max(read(CGROUP_CPU_MAX))
    if limit is not None:
        return limit
    quota, period = read(CGROUP_V1_QUOTA), read(CGROUP_V1_PERIOD)
    if quota and period:
        return parse_cpu_max(f"{quota} {period}")  # v1 says -1 for none
    return None


def gpu_numa_node(read: Reader = read_text) -> int | None:
    """The NUMA node of this process's GPU where vLLM's platform tells it (CUDA), else None."""
    try:
        from vllm.platforms import current_platform

        # is_cuda_alike first: vLLM's platform object warns about attributes it lacks
        if not current_platform.is_cuda_alike():
            return None
        lookup = getattr(current_platform, "get_device_numa_node", None)
        if lookup is None:
            return None
        device = 0
        try:
            import torch

            if torch.cuda.is_initialized():
                device = torch.cuda.current_device()
        except Exception:
            pass
        node = lookup(device)
    except Exception:
        return None
    if node is None or int(node) < 0:
        return None
    # a node without CPUs (a GPU's own memory node) is no place for the draft
    return int(node) if read(f"{SYS_NODE}/node{int(node)}/cpulist") else None


@dataclass(frozen=True)
class CoreChoice:
    """The draft's cores; ``shared``: the target is bound to them too; ``reason``: for the log."""

    cores: list[int]
    shared: bool
    reason: str


def choose_draft_cores(available: Iterable[int], taken: Iterable[int] | None,
                       topology: Topology | None = None, quota: int | None = None,
                       preferred_node: int | None = None,
                       max_threads: int = MAX_DRAFT_THREADS) -> CoreChoice:
    """The draft's cores when the user names none, one CPU per physical core (a second
    hyperthread gains llama.cpp nothing), at most ``max_threads``.

    * ``taken`` (the target's cores from vLLM's CPU binding): free cores, those sharing no
      hyperthread with the target first, within the ``quota`` left; none: the last CPU, shared.
    * ``None`` (no binding, as on a GPU): cores of one NUMA node (``preferred_node``, else the
      one with the most), at most half the node and half the quota, so vLLM's processes keep
      the rest; highest-numbered first, as the OS favours low ones.
    """
    allowed = sorted(set(available))
    topo = topology or Topology({c: (c,) for c in allowed}, {c: 0 for c in allowed})
    bound_by_vllm = taken is not None
    taken = set(taken or ())
    want = max_threads
    if bound_by_vllm:
        candidates = [c for c in allowed if c not in taken]
        bound = sorted(taken & set(allowed))
        if not candidates:
            return CoreChoice(allowed[-1:], True,
                              f"vLLM's CPU binding takes every CPU ({_span(bound)}): "
                              "the draft shares the last one")
        why = [f"vLLM's CPU binding takes {_span(bound)}"]
        if quota is not None:
            want = min(want, max(1, quota - len(bound)))
            why.append(f"cgroup CPU quota {quota} CPUs")
    else:
        why = ["vLLM binds no CPU threads (as on GPU vLLM)"]
        candidates = allowed
        if quota is not None:
            want = min(want, max(1, quota // 2))
            why.append(f"cgroup CPU quota {quota} CPUs, half for the draft")

    # one CPU per physical core: its lowest-numbered candidate hyperthread
    cores: dict[int, int] = {}
    for c in candidates:
        core = topo.core_of(c)
        cores[core] = min(cores.get(core, c), c)
    clean = {core for core in cores
             if not any(s in taken for s in topo.siblings.get(cores[core], (core,)))}
    by_node: dict[int, list[int]] = {}
    for core, cpu in cores.items():
        by_node.setdefault(topo.node(cpu), []).append(core)
    if not by_node:  # no CPU at all: let the process keep the mask it has
        return CoreChoice([], False, "no CPUs listed")
    if preferred_node is not None and preferred_node in by_node:
        node, node_why = preferred_node, "the GPU's"
    else:
        node = max(by_node, key=lambda n: (sum(c in clean for c in by_node[n]),
                                           len(by_node[n]), -n))
        node_why = "the only one" if len(by_node) == 1 else "the one with the most free cores"
        if preferred_node is not None:
            node_why += f"; the GPU's node {preferred_node} has none free"
    pool = by_node[node]
    if not bound_by_vllm:  # vLLM's processes may run anywhere: leave them half the node
        want = min(want, max(1, len(pool) // 2))
    # cores that share no hyperthread with the target first, then the highest-numbered
    ranked = sorted(pool, key=lambda core: (core in clean, core), reverse=True)
    chosen = sorted(cores[core] for core in ranked[:want])
    half_used = [core for core in ranked[:want] if core not in clean]
    why.append(f"{len(chosen)} of {len(pool)} free physical cores of NUMA node {node} "
               f"({node_why}), one hyperthread each")
    if len(chosen) == max_threads:
        why.append(f"at most {max_threads} for a draft model")
    if half_used:
        why.append(f"{len(half_used)} of them hyperthread siblings of the target's cores")
    return CoreChoice(chosen, False, "; ".join(why))


def draft_threads(n_threads: int | None, n_cores: int,
                  max_threads: int = MAX_DRAFT_THREADS) -> tuple[int, str | None]:
    """(llama.cpp's thread count on ``n_cores`` cores, a warning if ``n_threads`` was
    lowered): never more than the cores, as threads sharing a core spin at barriers."""
    n_cores = max(1, n_cores)
    if n_threads is None:
        return min(n_cores, max_threads), None
    if n_threads > n_cores:
        return n_cores, (f"n_threads {n_threads} is more than the draft's {n_cores} cores; "
                         f"using {n_cores} (llama.cpp's threads wait for each other at every "
                         f"op). Fix: give draft_cores at least n_threads CPUs")
    return n_threads, None


def _span(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"CPUs 0-2,5"``."""
    if not cpus:
        return "no CPUs"
    runs, start = [], cpus[0]
    for a, b in zip(cpus, cpus[1:] + [math.inf]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ("CPU " if len(cpus) == 1 else "CPUs ") + ",".join(runs)
