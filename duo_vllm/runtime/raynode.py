"""The Ray instance the draft actor lives in: DuoProposer's private one (on loopback,
its daemons on the draft's cores), or a cluster the user names; and a check that a
node offers the resources the actor asks for."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

from duo_vllm.config import DuoConfig, DuoConfigError, allowed_cpus
from duo_vllm.host.pinning import pin_ray_daemons


@contextmanager
def daemon_affinity(cores: list[int] | None):
    """Start Ray's daemons (raylet, GCS, idle workers) on ``cores``, else on any CPU of
    the container: vLLM's CPU worker binds the calling thread to the target's cores,
    and child processes would inherit that mask."""
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cores or allowed_cpus())
    except OSError:
        pass
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def private_ray(cfg: DuoConfig) -> bool:
    """Does DuoProposer start a Ray instance of its own (no cluster named)?"""
    return cfg.ray_address is None and not os.environ.get("RAY_ADDRESS")


def ensure_ray(cfg: DuoConfig, cores: list[int] | None = None):
    """Ray, initialised in this process if it is not; a private instance's daemons run on
    ``cores`` (``None``: anywhere)."""
    import ray

    if ray.is_initialized():
        return ray
    kwargs = dict(namespace=cfg.namespace, include_dashboard=False,
                  logging_level=logging.WARNING, log_to_driver=True)
    if private_ray(cfg):
        # A private local instance, on loopback only: nothing off this machine can reach
        # it. Small object store: our messages are tiny.
        # address="local": a new instance even if `ray start` left one running here.
        kwargs["address"] = "local"
        kwargs["object_store_memory"] = 128 * 1024 * 1024
        kwargs["_node_ip_address"] = "127.0.0.1"
    else:
        kwargs["address"] = cfg.ray_address
    # Ray's daemons would write their own metrics into vLLM's multiprocess metrics
    # directory (duo-vllm serve sets it) and flood /metrics with ray_* series
    metrics_dir = os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    try:
        local = kwargs["address"] == "local"
        with daemon_affinity(cores if local else None):
            ray.init(**kwargs)
        if local and cores:  # some start from threads of their own, with another mask
            pin_ray_daemons(cores)
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
