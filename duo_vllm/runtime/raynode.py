"""The Ray instance of the draft actor: a private one on loopback, or the user's cluster;
and a check that some node can place the actor."""

from __future__ import annotations

import logging
import os
from contextlib import suppress

from duo_vllm.config import DuoConfig, DuoConfigError, allowed_cpus


def ensure_ray(cfg: DuoConfig):
    """Ray, initialised if it is not."""
    import ray

    if ray.is_initialized():
        return ray
    kwargs = dict(namespace=cfg.namespace, include_dashboard=False,
                  logging_level=logging.WARNING, log_to_driver=True)
    if cfg.ray_address is None and not os.environ.get("RAY_ADDRESS"):  # no cluster named
        # "local": a new instance even beside a `ray start` one; loopback: unreachable
        # from other machines; a small object store: the messages are tiny
        kwargs.update(address="local", object_store_memory=128 * 1024 * 1024,
                      _node_ip_address="127.0.0.1")
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
    finally:
        if metrics_dir is not None:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        os.sched_setaffinity(0, before)
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
