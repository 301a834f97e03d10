"""Keep the draft actor, Ray's daemons and vLLM's engine core off the target's cores.

A CPU target is only as fast as it is while it has its cores to itself. Once the
draft occupies the spare cores, Linux balances other processes onto the target's:
vLLM's engine core busy-polls the worker (``shm_broadcast``), Ray's daemons inherit
the mask of the thread that starts them, and ``sched_setaffinity(0, ...)`` pins one
thread only. Everything here is best effort: what cannot be moved stays put.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

PROC = "/proc"
ENGINE_CORE_NAME = "VLLM::EngineCor"  # a process's comm is cut at 15 characters


def off_target(available: list[int], target: list[int] | None) -> list[int] | None:
    """Every available core but the target's; ``None`` (leave them be) when vLLM binds no
    cores or all of them."""
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
    """Pin every thread of ``pid`` to ``cores``; the number pinned (others are skipped)."""
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
    """Pin ``pids`` and every process below them, all threads; the processes pinned."""
    done = set()
    for pid in pids:
        for p in [pid, *descendants(pid, proc)]:
            if p not in done and pin_threads(p, cores, proc):
                done.add(p)
    return len(done)


def pin_ray_daemons(cores: list[int]) -> int:
    """Pin the processes of the private Ray node this process started, and their children;
    the number pinned. Relies on Ray's private ``_global_node``."""
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
    """vLLM's engine core process when it is this worker's parent, else ``None``."""
    parent = os.getppid()
    return parent if process_name(parent, proc).startswith(ENGINE_CORE_NAME) else None


def move_engine_core(cores: list[int], proc: str = PROC) -> int | None:
    """Pin vLLM's engine core (:func:`engine_core`) to ``cores``; its pid, or ``None``."""
    pid = engine_core(proc)
    return pid if pid is not None and pin_threads(pid, cores, proc) else None


class EngineCorePlace:
    """vLLM's engine core beside a lending target: on the draft's cores while drafting,
    where vLLM left it while the target has every core (pinned onto a target core, its
    busy-polling would take that core's time)."""

    def __init__(self, pid: int, drafting: list[int], proc: str = PROC):
        self.pid, self.drafting, self.proc = pid, list(drafting), proc
        self.free = sorted(os.sched_getaffinity(pid))  # vLLM's placement

    def use(self, lent: bool) -> None:
        pin_threads(self.pid, self.free if lent else self.drafting, self.proc)
