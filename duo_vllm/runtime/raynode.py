"""The Ray instance of the draft actor: a private one on loopback, or the user's cluster;
a check that some node can place the actor; and the private instance's daemons kept in
the background."""

from __future__ import annotations

import logging
import os
from contextlib import suppress

from duo_vllm.config import DuoConfig, DuoConfigError, allowed_cpus
from duo_vllm.runtime.actor import each_thread


_private: str | None = None  # the session of the private instance ensure_ray started


def ensure_ray(cfg: DuoConfig):
    """Ray, initialised if it is not."""
    global _private
    import ray

    if ray.is_initialized():
        return ray
    kwargs = dict(namespace=cfg.namespace, include_dashboard=False,
                  logging_level=logging.WARNING, log_to_driver=True)
    if cfg.ray_address is None and not os.environ.get("RAY_ADDRESS"):  # no cluster named
        # "local": a new instance even beside a `ray start` one; loopback: unreachable
        # from other machines; a small object store: the messages are tiny; no idle
        # workers started ahead: the actor's is the only worker process
        kwargs.update(address="local", object_store_memory=128 * 1024 * 1024,
                      _node_ip_address="127.0.0.1",
                      _system_config={"prestart_worker_first_driver": False})
    else:
        kwargs["address"] = cfg.ray_address
    before = os.sched_getaffinity(0)
    # hidden from Ray, whose daemons would flood vLLM's multiprocess /metrics with ray_*
    metrics_dir = os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    try:
        # Ray's daemons on every allowed CPU, not on the target's cores of vLLM's worker thread
        with suppress(OSError):
            os.sched_setaffinity(0, allowed_cpus())
        ray.init(**kwargs)
        if kwargs["address"] == "local":
            _private = ray.get_runtime_context().get_session_name()
    finally:
        if metrics_dir is not None:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        os.sched_setaffinity(0, before)
    return ray


def descendants(roots, parents: dict[int, int]) -> set[int]:
    """``roots`` and every process below them, from a pid -> parent pid map."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def _parents(proc: str = "/proc") -> dict[int, int]:
    out = {}
    for name in filter(str.isdigit, os.listdir(proc)):
        with suppress(OSError, ValueError, IndexError):
            with open(f"{proc}/{name}/stat") as f:
                stat = f.read()
            out[int(name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return out


def background_daemons(keep: int) -> int:
    """The private instance's daemons (GCS, raylet, agents, monitors) and any worker but the
    draft actor's process ``keep`` under ``SCHED_IDLE``: they run when a core has nothing
    else to run and never preempt the target's threads, which share the cores on vLLM-CPU
    (docs/design.md). Nothing on the step's path goes through them: the step's calls go to
    the actor. Returns the threads moved; 0 for a cluster the user started (its daemons
    are not ours) or where Linux refuses."""
    import ray

    if _private is None or not hasattr(os, "SCHED_IDLE") or not ray.is_initialized():
        return 0
    try:  # the processes ray.init started; the agents and workers are their children
        if ray.get_runtime_context().get_session_name() != _private:
            return 0  # an instance started since, by someone else
        node = ray._private.worker._global_node
        roots = [p.process.pid for infos in node.all_processes.values() for p in infos]
    except Exception:
        return 0
    parents = _parents()
    moved = 0
    for pid in descendants(roots, parents) - descendants([keep], parents):
        with suppress(OSError):  # a process that ended meanwhile
            moved += each_thread(
                lambda tid: os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0)),
                pid, ignore=OSError)
    return moved


def check_placement(ray, cfg: DuoConfig) -> None:
    """Fail at start-up, not hang, when no node offers the actor's ``resources``."""
    if not cfg.resources:
        return
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if any(all(n["Resources"].get(k, 0) >= v for k, v in cfg.resources.items()) for n in nodes):
        return
    offered = sorted({k for n in nodes for k in n["Resources"] if not k.startswith("node:")})
    raise DuoConfigError(
        f"DuoProposer resources {cfg.resources} are offered by no node of the Ray cluster "
        f"({len(nodes)} node(s); resources offered: {offered}). Fix: start the draft's node "
        f"with `ray start ... --resources '{{\"{next(iter(cfg.resources))}\": 1}}'`, or "
        "change the resources option")
