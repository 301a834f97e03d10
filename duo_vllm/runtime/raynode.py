"""The Ray instance of the draft actor: a private one on loopback, or the user's cluster;
and a check that some node can place the actor."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

from duo_vllm.config import DuoConfig, DuoConfigError, allowed_cpus


@contextmanager
def daemon_affinity():
    """Start Ray's daemons on every allowed CPU: they would inherit the target's core
    binding of vLLM's worker thread."""
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, allowed_cpus())
    except OSError:
        pass
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def private_ray(cfg: DuoConfig) -> bool:
    """Does DuoProposer start a Ray instance of its own (no cluster named)?"""
    return cfg.ray_address is None and not os.environ.get("RAY_ADDRESS")


def ensure_ray(cfg: DuoConfig):
    """Ray, initialised if it is not."""
    import ray

    if ray.is_initialized():
        return ray
    kwargs = dict(namespace=cfg.namespace, include_dashboard=False,
                  logging_level=logging.WARNING, log_to_driver=True)
    if private_ray(cfg):
        # "local": a new instance even beside a `ray start` one; loopback: unreachable
        # from other machines; a small object store: the messages are tiny
        kwargs["address"] = "local"
        kwargs["object_store_memory"] = 128 * 1024 * 1024
        kwargs["_node_ip_address"] = "127.0.0.1"
    else:
        kwargs["address"] = cfg.ray_address
    # else Ray's daemons flood vLLM's multiprocess /metrics with ray_* series
    metrics_dir = os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    try:
        with daemon_affinity():
            ray.init(**kwargs)
    finally:
        if metrics_dir is not None:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    return ray


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
