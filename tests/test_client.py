"""ActorClient: bounded waits, a dead actor replaced, plain decoding in between.

Real Ray actors, fake drafters: each answers ``propose`` with a known draft.
Each test that makes steps' calls runs twice: through Ray, and over the
actor's Unix socket (duo_vllm/runtime/channel.py), as DuoProposer calls an actor on
its own node.
"""

import logging
import os
import signal
import time

import pytest

from duo_vllm.runtime.channel import NoAnswer, RemoteError
from duo_vllm.runtime.client import AUTO_TIMEOUT_FIRST_S, ActorClient, _actor_gone, auto_timeout
from duo_vllm.runtime.message import StepRequest

log = logging.getLogger("test_client")


def test_auto_timeout_is_usual_answer_plus_half_a_step():
    assert auto_timeout(None, 0.05) == AUTO_TIMEOUT_FIRST_S
    assert auto_timeout(0.002, None) == AUTO_TIMEOUT_FIRST_S
    assert auto_timeout(0.010, 0.050) == pytest.approx(0.035)
    assert auto_timeout(0.010, 0.050, answer_dev_s=0.005) == pytest.approx(0.055)
    assert auto_timeout(0.0, 0.001) == pytest.approx(0.02)  # floor


class FakeWorker:
    """Drafts ``[len(context)] * budget``; ``delay`` seconds per call."""

    def __init__(self, delay=0.0, fail_start=False):
        if fail_start:
            raise RuntimeError("cannot load the draft")
        self.delay = delay

    def info(self):
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def set_delay(self, delay):
        self.delay = delay

    def set_broken(self):
        self.broken = True

    def prefetch(self, contexts):
        self.prefetched = getattr(self, "prefetched", []) + [len(c) for c in contexts]
        return len(contexts)

    def get_prefetched(self):
        return getattr(self, "prefetched", [])

    def pause(self, wait=False):
        self.prefetched = getattr(self, "prefetched", []) + ["paused"]
        if wait:
            time.sleep(self.delay)  # the decode call under way

    def propose(self, step):
        if getattr(self, "broken", False):
            raise ValueError("a bug in the drafter")
        time.sleep(self.delay)
        return [[len(c)] * b for c, b in zip(step.contexts, step.budgets)]


class SocketFakeWorker(FakeWorker):
    """The same, serving the step's calls on a Unix socket as DraftWorker does."""

    def open_channel(self):
        from duo_vllm.runtime.channel import ChannelServer

        if getattr(self, "channel", None) is None:
            self.channel = ChannelServer(self)
        return self.channel.address, self.channel.authkey


@pytest.fixture(params=[FakeWorker, SocketFakeWorker], ids=["ray", "socket"])
def worker(request):
    return request.param


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, namespace="duo_test_client",
             object_store_memory=128 * 1024 * 1024, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


def make_client(ray_local, worker=FakeWorker, timeout="auto", max_restarts=2, **kw):
    created = []

    def create():
        actor = ray_local.remote(num_cpus=0)(worker).remote(**kw)
        created.append(actor)
        return actor

    client = ActorClient(create, timeout, max_restarts, log)
    assert client.channel == (worker is SocketFakeWorker)
    return client, created


def propose_until(client, want, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = client.propose(StepRequest([[1, 2, 3]], [2], 0.05))
        if (out is not None) == want:
            return out
        time.sleep(0.05)
    raise AssertionError(f"propose() never returned {'a draft' if want else 'None'}")


def test_a_killed_actor_is_replaced_and_drafting_resumes(ray_local, worker, caplog):
    client, created = make_client(ray_local, worker)
    assert client.propose(StepRequest([[1, 2, 3]], [2], 0.05)) == [[3, 3]]
    pid = client.info["pid"]
    os.kill(pid, signal.SIGKILL)
    with caplog.at_level(logging.WARNING, logger="test_client"):
        # the step during which it died, and those while the new one starts: no draft
        assert propose_until(client, want=False) is None
        assert propose_until(client, want=True) == [[3, 3]]
    assert "draft actor is gone" in caplog.text and "draft actor restarted" in caplog.text
    assert client.restarts == 1 and len(created) == 2 and client.info["pid"] != pid
    assert client.channel == (worker is SocketFakeWorker)  # the new actor's socket


def test_prefetch_never_waits_nor_queues_behind_a_late_call_and_pause_queues_once(ray_local, worker):
    client, _ = make_client(ray_local, worker, timeout=0.2)
    assert client.prefetch([[1, 2, 3], [4]])  # handed over, in order before the next call
    assert client.pause()  # the gate turned drafting off
    assert client.propose(StepRequest([[1, 2, 3]], [1], 0.05)) == [[3]]
    assert client.call("get_prefetched") == [3, 1, "paused"]
    client.call("set_delay", 0.6)
    t0 = time.perf_counter()
    assert client.propose(StepRequest([[1]], [1], 0.05)) is None  # late: still in flight
    assert not client.prefetch([[9]])  # not queued behind a late call
    assert client.pause()  # queued: the actor drops its work once the late call ends
    assert not client.pause()  # ... once
    assert time.perf_counter() - t0 < 0.5  # neither waited for the late call
    client.submit("set_delay", 0.0)
    propose_until(client, want=True)
    assert client.call("get_prefetched") == [3, 1, "paused", "paused"]


def test_a_pause_before_a_lend_waits_for_the_actor_but_a_bounded_while(ray_local, worker):
    client, _ = make_client(ray_local, worker, timeout=0.5)
    assert client.propose(StepRequest([[1, 2, 3]], [1], 0.05)) == [[3]]
    client.call("set_delay", 0.2)  # its decode call under way ends in 0.2 s
    t0 = time.perf_counter()
    assert client.pause(wait_s=1.0)
    assert 0.2 <= time.perf_counter() - t0 < 0.9  # waited for it, not for the bound
    t0 = time.perf_counter()
    assert client.pause(wait_s=0.05)
    assert time.perf_counter() - t0 < 0.19  # a stuck actor costs the bound at most
    client.call("set_delay", 0.0)


def test_a_stalled_actor_costs_one_bounded_wait(ray_local, worker, caplog):
    client, _ = make_client(ray_local, worker, timeout=0.2)
    assert client.propose(StepRequest([[1]], [1], 0.05)) == [[1]]
    client.call("set_delay", 1.5)
    with caplog.at_level(logging.WARNING, logger="test_client"):
        t0 = time.perf_counter()
        assert client.propose(StepRequest([[1]], [1], 0.05)) is None  # waits 0.2 s, not 1.5 s
        waited = time.perf_counter() - t0
        t1 = time.perf_counter()
        # the late call is still in flight
        assert client.propose(StepRequest([[1]], [1], 0.05)) is None
        again = time.perf_counter() - t1
        client.submit("set_delay", 0.0)  # runs once the late call is done
        # steps go on without drafts; past STALL_WARN_S a warning, then drafting resumes
        assert propose_until(client, want=True) == [[3, 3]]
    assert 0.15 < waited < 1.0 and again < 0.15, (waited, again)
    assert "has not answered for" in caplog.text and "answers again" in caplog.text
    assert client.timeouts == 1 and client.restarts == 0


def test_a_slow_answer_is_counted_not_logged(ray_local, worker, caplog):
    client, _ = make_client(ray_local, worker, timeout=0.2)
    client.call("set_delay", 0.4)  # late, but no stall
    with caplog.at_level(logging.WARNING, logger="test_client"):
        assert client.propose(StepRequest([[1]], [1], 0.05)) is None
        client.submit("set_delay", 0.0)
        assert propose_until(client, want=True) == [[3, 3]]
    assert client.timeouts == 1 and caplog.text == ""


def test_a_drafter_bug_means_plain_decoding_for_good(ray_local, worker, caplog):
    client, _ = make_client(ray_local, worker)
    client.call("set_broken")  # the next call raises inside the actor
    with caplog.at_level(logging.ERROR, logger="test_client"):
        assert client.propose(StepRequest([[1]], [1], 0.05)) is None
    assert client.disabled and "falling back to plain decoding for good" in caplog.text
    assert client.propose(StepRequest([[1]], [1], 0.05)) is None


def test_ray_failures_restart_the_actor_and_drafter_bugs_do_not():
    from ray import exceptions as rex

    # Ray or the actor's process failed: a new actor may well work
    assert _actor_gone(rex.ActorDiedError())
    assert _actor_gone(rex.ActorUnavailableError("unreachable", b"\0" * 16))
    assert _actor_gone(rex.WorkerCrashedError())
    assert _actor_gone(rex.NodeDiedError("node gone"))
    assert _actor_gone(rex.RaySystemError("raylet gone"))
    assert _actor_gone(rex.ObjectLostError("00" * 28, None, "propose"))
    # the drafter's own code raised (Ray wraps it in RayTaskError): it would raise again
    assert not _actor_gone(rex.RayTaskError("propose", "Traceback ...", ValueError("bug")))
    assert not _actor_gone(ValueError("bug"))
    # the same over the actor's socket: closed with its process, or the drafter raised
    assert _actor_gone(EOFError()) and _actor_gone(BrokenPipeError())
    assert not _actor_gone(RemoteError("ValueError: bug"))
    assert not _actor_gone(NoAnswer("no answer to call 3 within 0.1 s"))  # late, not gone
    # through Ray, a drafter's own OSError comes as RayTaskError and OSError at once
    bug = rex.RayTaskError("propose", "Traceback ...", TimeoutError("bug")).as_instanceof_cause()
    assert isinstance(bug, OSError) and not _actor_gone(bug)


def test_restarts_are_bounded(ray_local, worker, caplog):
    client, created = make_client(ray_local, worker, max_restarts=1)
    os.kill(client.info["pid"], signal.SIGKILL)
    propose_until(client, want=False)
    propose_until(client, want=True)
    os.kill(client.info["pid"], signal.SIGKILL)
    with caplog.at_level(logging.ERROR, logger="test_client"):
        deadline = time.monotonic() + 30
        while not client.disabled and time.monotonic() < deadline:
            assert client.propose(StepRequest([[1]], [1], 0.05)) is None or not client.disabled
            time.sleep(0.05)
    assert client.disabled and len(created) == 2
    assert "failed after 1 restart(s)" in caplog.text
