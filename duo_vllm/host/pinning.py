"""Which process runs on which cores: the draft actor, Ray's daemons, vLLM's engine core.

On vLLM-CPU the target is bound to its cores, and it is as fast as it is only
while it has them to itself. Plain vLLM leaves every other process free to run
anywhere, and on a box with few cores that costs it nothing: the spare cores
are idle. With a draft on the spare cores, the scheduler moves whatever is
left onto the target's:

- vLLM's engine core process polls the worker for each step's output,
  busy-looping with ``sched_yield`` (``shm_broadcast``); while the draft
  computes on the spare core, Linux balances the poller onto the target's
  core, and the target loses time slices to it;
- Ray's daemons (raylet, GCS, idle workers, agents) start with whatever mask
  the thread that starts them has;
- ``sched_setaffinity(0, ...)`` pins one thread, and a Ray actor's process has
  threads of its own before the actor pins itself.

The functions here move each of them off the target's cores. All of it is
best effort: a thread or process that cannot be moved is left where it is
(Ray's daemons not found is logged at debug level); it never stops vLLM.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

PROC = "/proc"
ENGINE_CORE_NAME = "VLLM::EngineCor"  # a process's comm is cut at 15 characters


def off_target(available: list[int], target: list[int] | None) -> list[int] | None:
    """The cores for vLLM's and Ray's other processes: every available one but the
    target's; ``None`` (leave them be) when vLLM binds no cores, or binds them all."""
    if not target:
        return None
    rest = sorted(set(available) - set(target))
    return rest or None


def threads(pid: int | str = "self", proc: str = PROC) -> list[int]:
    """Thread ids of a process (Linux); none where /proc does not list them."""
    try:
        return [int(t) for t in os.listdir(f"{proc}/{pid}/task")]
    except OSError:
        return []


def pin_threads(pid: int | str, cores: list[int], proc: str = PROC) -> int:
    """Pin every thread of process ``pid`` to ``cores``; the number of threads pinned
    (threads that ended meanwhile, or that we may not move, are skipped)."""
    pinned = 0
    for tid in threads(pid, proc):
        try:
            os.sched_setaffinity(tid, cores)
            pinned += 1
        except OSError:
            pass
    return pinned


def descendants(pid: int, proc: str = PROC) -> list[int]:
    """Every process below ``pid`` (each after its parent), from /proc's children lists."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for tid in threads(parent, proc):
            try:
                with open(f"{proc}/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def process_name(pid: int, proc: str = PROC) -> str:
    try:
        with open(f"{proc}/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def pin_tree(pids: list[int], cores: list[int], proc: str = PROC) -> int:
    """Pin ``pids`` and every process below them, all their threads; processes pinned.

    Processes started later by one of them inherit its mask."""
    done = set()
    for pid in pids:
        for p in [pid, *descendants(pid, proc)]:
            if p not in done and pin_threads(p, cores, proc):
                done.add(p)
    return len(done)


def pin_ray_daemons(cores: list[int]) -> int:
    """Pin the processes of the Ray node this process started (``ray.init`` with a
    private local instance) and their children; the number pinned (0: none known)."""
    try:
        import ray

        node = ray._private.worker._global_node  # private: best effort
        pids = [info.process.pid for infos in node.all_processes.values() for info in infos
                if getattr(info, "process", None) is not None]
    except Exception as e:  # another Ray version, or no local node
        logger.debug("duo_vllm: Ray's daemons not found (%s: %s)", type(e).__name__, e)
        return 0
    return pin_tree(pids, cores)


def engine_core(proc: str = PROC) -> int | None:
    """vLLM's engine core process, when it is this worker's parent; ``None`` where the
    parent is no engine core (one process, GPU vLLM's uniprocess executor, tests)."""
    parent = os.getppid()
    return parent if process_name(parent, proc).startswith(ENGINE_CORE_NAME) else None


def move_engine_core(cores: list[int], proc: str = PROC) -> int | None:
    """Pin vLLM's engine core process (:func:`engine_core`) to ``cores``; its pid, or
    ``None`` where there is none."""
    pid = engine_core(proc)
    return pid if pid is not None and pin_threads(pid, cores, proc) else None


class EngineCorePlace:
    """vLLM's engine core beside a target that lends it the draft's cores: on those
    cores while the draft drafts (off the target's), where vLLM left it while the
    target runs on every core, as in plain vLLM.

    Pinned to a core the target runs on too, its busy-polling took 3-4x the CPU
    time it takes unpinned, on the core of one of the target's OpenMP threads
    (batch 16, `benchmarks/README.md`).
    """

    def __init__(self, pid: int, drafting: list[int], proc: str = PROC):
        self.pid, self.drafting, self.proc = pid, list(drafting), proc
        self.free = sorted(os.sched_getaffinity(pid))  # vLLM's placement

    def use(self, lent: bool) -> None:
        pin_threads(self.pid, self.free if lent else self.drafting, self.proc)
