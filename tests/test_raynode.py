"""The private Ray instance's processes: which are kept in the background, and the draft
actor back in the foreground (the real instance: test_proposer.py,
test_ray_actor_is_named_pinned_and_shared)."""

import logging
import os

import pytest

from duo_vllm.runtime import actor as actor_mod
from duo_vllm.runtime import raynode
from duo_vllm.runtime.raynode import background_daemons, descendants

needs_sched_idle = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux only")


def test_descendants_are_the_roots_and_everything_below_them():
    # 10 ray.init's GCS, 11 its raylet; 20 and 21 the raylet's agent and actor; 30 the
    # actor's child; 5 and 6 vLLM's own, not Ray's
    parents = {10: 1, 11: 1, 20: 11, 21: 11, 30: 21, 5: 1, 6: 5}
    assert descendants([10, 11], parents) == {10, 11, 20, 21, 30}
    assert descendants([10, 11], parents) - descendants([21], parents) == {10, 11, 20}
    assert descendants([], parents) == set()


def test_an_instance_not_started_here_is_left_alone(monkeypatch):
    monkeypatch.setattr(raynode, "_private", None)
    assert background_daemons(keep=os.getpid()) == 0


@needs_sched_idle
def test_an_actor_that_inherited_sched_idle_returns_to_the_foreground(monkeypatch):
    policies = {}
    monkeypatch.setattr(os, "sched_getscheduler", lambda pid: os.SCHED_IDLE)
    monkeypatch.setattr(os, "sched_setscheduler",
                        lambda tid, policy, param: policies.__setitem__(tid, policy))
    assert actor_mod.foreground()
    assert os.getpid() in policies and len(policies) == len(os.listdir("/proc/self/task"))
    assert set(policies.values()) == {os.SCHED_OTHER}


@needs_sched_idle
def test_where_linux_refuses_the_actor_says_it_drafts_on_idle_cores_only(monkeypatch, caplog):
    def refuse(tid, policy, param):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_getscheduler", lambda pid: os.SCHED_IDLE)
    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    with caplog.at_level(logging.WARNING):
        assert not actor_mod.foreground()
    assert "SCHED_IDLE" in caplog.text and "CAP_SYS_NICE" in caplog.text


@needs_sched_idle
def test_an_actor_in_the_foreground_changes_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "sched_getscheduler", lambda pid: os.SCHED_OTHER)
    monkeypatch.setattr(os, "sched_setscheduler", lambda *a: calls.append(a))
    assert actor_mod.foreground() and not calls
