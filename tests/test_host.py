"""The draft's cores on a real host (issue 14, item 3), on fake /sys trees:
2, 64 and 192 CPUs, hyperthread siblings, two NUMA nodes, a cgroup CPU quota."""

import logging

import pytest

from duo_vllm.runtime.actor import node_draft_cores
from duo_vllm.config import DuoConfig, HostFacts, choose_cores, resolve_draft_cores
from duo_vllm.host.cores import (
    MAX_DRAFT_THREADS, cgroup_cpu_limit, choose_draft_cores, draft_threads, parse_cpu_max,
    read_topology,
)


def fake_sys(n_cpus, smt=1, nodes=1, cpu_max=None):
    """A /sys reader for ``n_cpus`` CPUs: ``smt`` hyperthreads per core numbered as
    Linux does on x86 (cpu c and c + n_cpus/smt share a core), cores split evenly over
    ``nodes`` NUMA nodes, and the cgroup v2 ``cpu.max``."""
    cores = n_cpus // smt
    per_node = cores // nodes
    files = {"/sys/devices/system/node/online": f"0-{nodes - 1}" if nodes > 1 else "0"}
    for c in range(n_cpus):
        sib = [c % cores + i * cores for i in range(smt)]
        files[f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list"] = \
            ",".join(map(str, sib))
    for n in range(nodes):
        span = [f"{n * per_node + i * cores}-{(n + 1) * per_node - 1 + i * cores}"
                for i in range(smt)]
        files[f"/sys/devices/system/node/node{n}/cpulist"] = ",".join(span)
    if cpu_max is not None:
        files["/sys/fs/cgroup/cpu.max"] = cpu_max
    return files.get


def host(n_cpus, smt=1, nodes=1, cpu_max=None, gpu_node=None):
    read = fake_sys(n_cpus, smt, nodes, cpu_max)
    return HostFacts(read_topology(range(n_cpus), read), cgroup_cpu_limit(read), gpu_node)


def physical(cores, n_cpus, smt):
    return {c % (n_cpus // smt) for c in cores}


def test_fake_sys_reads_as_linux_writes_it():
    topo = read_topology(range(64), fake_sys(64, smt=2, nodes=2))
    assert topo.siblings[3] == (3, 35) and topo.siblings[35] == (3, 35)
    assert topo.node(3) == 0 and topo.node(35) == 0 and topo.node(16) == 1 and topo.node(63) == 1


def test_two_cpus_target_on_core_0_draft_on_core_1():
    """This machine: vLLM-CPU's binding takes core 0, the draft gets core 1, as before."""
    h = host(2)
    c = choose_cores(DuoConfig(), [0, 1], {"VLLM_CPU_OMP_THREADS_BIND": "0"}, h)
    assert (c.cores, c.shared) == ([1], False)
    c = choose_cores(DuoConfig(), [0, 1], {"OMP_PLACES": "{0}"}, h)
    assert (c.cores, c.shared) == ([1], False)
    assert draft_threads(None, 1) == (1, None)


def test_two_cpus_without_a_binding_leave_core_0_to_vllm():
    """GPU vLLM binds nothing: the draft takes the last core but does not claim to
    share it with a target binding that does not exist (before: "shared", and a
    warning to set VLLM_CPU_OMP_THREADS_BIND, which GPU vLLM ignores)."""
    c = choose_cores(DuoConfig(), [0, 1], {}, host(2))
    assert (c.cores, c.shared) == ([1], False)
    assert "binds no CPU threads" in c.reason


@pytest.mark.parametrize("n_cpus, gpu_node", [(64, 1), (64, 0), (192, 1), (192, None)])
def test_a_gpu_host_gives_the_draft_a_few_physical_cores_of_one_node(n_cpus, gpu_node):
    h = host(n_cpus, smt=2, nodes=2, gpu_node=gpu_node)
    c = choose_cores(DuoConfig(), list(range(n_cpus)), {}, h)
    assert len(c.cores) == MAX_DRAFT_THREADS  # not 64 or 192
    assert len(physical(c.cores, n_cpus, 2)) == len(c.cores)  # one hyperthread per core
    want_node = 0 if gpu_node is None else gpu_node
    assert {h.topology.node(x) for x in c.cores} == {want_node}
    assert not c.shared and f"NUMA node {want_node}" in c.reason
    assert draft_threads(None, len(c.cores))[0] == MAX_DRAFT_THREADS


def test_the_gpu_node_wins_only_where_it_has_cores():
    h = host(64, smt=2, nodes=2, gpu_node=1)
    allowed = [c for c in range(64) if h.topology.node(c) == 0]  # a cpuset of node 0 only
    c = choose_cores(DuoConfig(), allowed, {}, h)
    assert {h.topology.node(x) for x in c.cores} == {0}
    assert "GPU's node 1 has none free" in c.reason


def test_a_vllm_cpu_binding_leaves_the_target_its_hyperthreads():
    """vLLM-CPU bound to CPUs 0-15 of 64 (2 hyperthreads a core): CPUs 32-47 are free
    but are the second hyperthreads of the target's cores. The draft takes cores
    the target does not touch instead, 8 of them, not all 48 free CPUs."""
    h = host(64, smt=2, nodes=2)
    c = choose_cores(DuoConfig(), list(range(64)), {"VLLM_CPU_OMP_THREADS_BIND": "0-15"}, h)
    assert len(c.cores) == MAX_DRAFT_THREADS
    assert physical(c.cores, 64, 2).isdisjoint(range(16))
    assert not c.shared and "binding takes CPUs 0-15" in c.reason


def test_per_rank_bindings_all_count_as_the_targets():
    c = choose_cores(DuoConfig(), list(range(8)), {"VLLM_CPU_OMP_THREADS_BIND": "0-2|3-5"},
                     host(8))
    assert c.cores == [6, 7]


@pytest.mark.parametrize("cpu_max, want", [("400000 100000", 2), ("150000 100000", 1),
                                           ("max 100000", MAX_DRAFT_THREADS)])
def test_the_cgroup_quota_bounds_the_draft(cpu_max, want):
    """A 192-CPU host whose container may use 4 CPUs' worth of time: the draft takes
    half (vLLM's processes share the quota), not 8 cores it cannot run."""
    h = host(192, smt=2, nodes=2, cpu_max=cpu_max)
    c = choose_cores(DuoConfig(), list(range(192)), {}, h)
    assert len(c.cores) == want
    assert ("cgroup CPU quota" in c.reason) == (want != MAX_DRAFT_THREADS)


def test_the_quota_left_after_a_vllm_cpu_binding():
    h = host(64, smt=2, nodes=2, cpu_max="600000 100000")
    c = choose_cores(DuoConfig(), list(range(64)), {"VLLM_CPU_OMP_THREADS_BIND": "0-3"}, h)
    assert len(c.cores) == 2  # 6 CPUs of quota, 4 bound to the target


def test_cpu_max_and_cgroup_v1_quota():
    assert parse_cpu_max("max 100000") is None and parse_cpu_max(None) is None
    assert parse_cpu_max("250000 100000") == 2 and parse_cpu_max("50000 100000") == 1
    v1 = {"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "300000",
          "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"}
    assert cgroup_cpu_limit(v1.get) == 3
    assert cgroup_cpu_limit({**v1, "/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1"}.get) is None
    assert cgroup_cpu_limit({}.get) is None


def test_explicit_draft_cores_are_respected_on_a_big_host():
    """draft_cores 5 and 101 are hyperthreads of one core on the 192-CPU host: the
    user asked for them, they get them (no choice, no quota, no NUMA preference)."""
    h = host(192, smt=2, nodes=2, cpu_max="200000 100000", gpu_node=1)
    c = choose_cores(DuoConfig(draft_cores=(5, 101)), list(range(192)), {}, h)
    assert (c.cores, c.shared) == ([5, 101], False) and c.reason == "the draft_cores option"
    assert draft_threads(None, 2) == (2, None)


def test_thread_count_is_capped():
    assert draft_threads(None, 192) == (MAX_DRAFT_THREADS, None)
    assert draft_threads(3, 192) == (3, None)  # the user's, below the cores
    threads, warning = draft_threads(16, 4)
    assert threads == 4 and "n_threads 16 is more than the draft's 4 cores" in warning


def test_the_choice_is_logged_with_its_reason(caplog, monkeypatch):
    monkeypatch.setattr("duo_vllm.logs.vllm_logger", logging.getLogger)  # no vLLM import
    h = host(192, smt=2, nodes=2, gpu_node=1)
    with caplog.at_level(logging.INFO):
        cores, shared = resolve_draft_cores(DuoConfig(), list(range(192)), {}, host=h)
    assert len(cores) == MAX_DRAFT_THREADS and not shared
    line = [r.getMessage() for r in caplog.records if "draft cores" in r.getMessage()]
    assert len(line) == 1 and "8 llama.cpp thread(s)" in line[0] and "NUMA node 1" in line[0]


def test_an_actor_placed_by_resources_chooses_on_its_own_node(caplog, monkeypatch):
    """With resources and no draft_cores the actor used every CPU of its node
    (192 threads on this host); now it takes a few physical cores there."""
    monkeypatch.setattr(logging.getLogger("duo_vllm"), "propagate", True)  # to caplog
    with caplog.at_level(logging.INFO, logger="duo_vllm"):
        cores = node_draft_cores(DuoConfig(resources={"duo_draft": 1}), list(range(192)), {},
                                 host(192, smt=2, nodes=2))
    assert len(cores) == MAX_DRAFT_THREADS
    assert any("draft cores" in r.getMessage() for r in caplog.records)


def test_choose_draft_cores_without_topology_treats_each_cpu_as_a_core():
    assert choose_draft_cores([0, 1, 2, 3], None).cores == [2, 3]
    assert choose_draft_cores([0, 1], [0, 1]).cores == [1]  # nothing free: shares the last
    assert choose_draft_cores([0, 1], [0, 1]).shared


_PIN_CHILD = """
import os, sys, threading
from duo_vllm.runtime.actor import pin_process
ready, stop = threading.Event(), threading.Event()
tid = []
def early():  # a thread started before the pin, as Ray's are in an actor's process
    tid.append(threading.get_native_id()); ready.set(); stop.wait()
t = threading.Thread(target=early); t.start(); ready.wait()
cpu = int(sys.argv[1])
pin_process([cpu])
print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(tid[0])))
stop.set(); t.join()
"""


def test_pin_process_pins_threads_started_before_it():
    """The draft actor's process has threads (Ray's) before it pins itself: every one of
    them must leave the target's cores, not only the thread that pins."""
    import os
    import subprocess
    import sys

    cpu = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", _PIN_CHILD, str(cpu)], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split("\n")[0]
    assert out == f"[{cpu}] [{cpu}]"
