"""ActorClient: bounded waits, a dead actor replaced, plain decoding in between.

Real Ray actors, fake drafters: each answers ``propose`` with a known draft.
Each test that makes steps' calls runs twice: through Ray, and over the
actor's Unix socket (duo_vllm/runtime/channel.py), as DuoProposer calls an actor on
its own node. A call the test holds (``hold``: it runs until the test creates a
file) shows what the client did while the actor was busy, with no clock: a wait
for that call would outlast the hold's own bound, which the actor records.
"""

import logging
import os
import signal
import threading
import time

import pytest

from duo_vllm.runtime.channel import Channel, NoAnswer, RayCalls, RemoteError
from duo_vllm.runtime.client import AUTO_TIMEOUT_FIRST_S, ActorClient, _actor_gone, auto_timeout
from duo_vllm.runtime.message import StepRequest

log = logging.getLogger("test_client")


def test_auto_timeout_is_usual_answer_plus_half_a_step():
    assert auto_timeout(None, 0.05) == AUTO_TIMEOUT_FIRST_S
    assert auto_timeout(0.002, None) == AUTO_TIMEOUT_FIRST_S
    assert auto_timeout(0.010, 0.050) == pytest.approx(0.035)
    assert auto_timeout(0.010, 0.050, answer_dev_s=0.005) == pytest.approx(0.055)
    assert auto_timeout(0.0, 0.001) == pytest.approx(0.02)  # floor


HOLD_BOUND_S = 60.0  # a held call ends by itself after this (and says so): no test hangs


class FakeDraftActor:
    """A draft actor that drafts ``[len(context)] * budget``; ``delay`` seconds per call.

    ``hold(path)``: its next ``propose`` (or ``pause`` that waits) runs until a file
    ``path`` exists. It creates ``path.started`` as it begins and ``path.done`` as it
    ends, and records whether the test released it or its bound ran out (``held()``).
    """

    def __init__(self, delay=0.0, fail_start=False):
        if fail_start:
            raise RuntimeError("cannot load the draft")
        self.delay = delay
        self.proposes, self.outcomes, self.hold_path = 0, [], None

    def hold(self, path):
        self.hold_path = path

    def held(self):
        return self.outcomes

    def propose_calls(self):
        return self.proposes

    def _run_held(self):
        path, self.hold_path = self.hold_path, None
        if path is None:
            return
        open(path + ".started", "w").close()
        deadline = time.monotonic() + HOLD_BOUND_S
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.005)
        self.outcomes.append("released" if os.path.exists(path) else "expired")
        open(path + ".done", "w").close()

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
            self._run_held()  # the decode call under way
            time.sleep(self.delay)

    def propose(self, step):
        self.proposes += 1
        if getattr(self, "broken", False):
            raise ValueError("a bug in the drafter")
        self._run_held()
        time.sleep(self.delay)
        return [[len(c)] * b for c, b in zip(step.contexts, step.budgets)]


class SocketFakeDraftActor(FakeDraftActor):
    """The same, serving the step's calls on a Unix socket as DraftWorker does."""

    def open_channel(self):
        from duo_vllm.runtime.channel import ChannelServer

        if getattr(self, "channel", None) is None:
            self.channel = ChannelServer(self)
        return self.channel.address, self.channel.authkey


@pytest.fixture(params=[FakeDraftActor, SocketFakeDraftActor], ids=["ray", "socket"])
def worker(request):
    return request.param


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, namespace="duo_test_client",
             object_store_memory=128 * 1024 * 1024, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


def make_client(ray_local, worker=FakeDraftActor, timeout="auto", max_restarts=2, **kw):
    created = []

    def create():
        actor = ray_local.remote(num_cpus=0)(worker).remote(**kw)
        created.append(actor)
        return actor

    client = ActorClient(create, timeout, max_restarts, log)
    assert client.channel == (worker is SocketFakeDraftActor)
    return client, created


def propose_until(client, want, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = client.propose(StepRequest([[1, 2, 3]], [2], 0.05))
        if (out is not None) == want:
            return out
        time.sleep(0.05)
    raise AssertionError(f"propose() never returned {'a draft' if want else 'None'}")


def wait_for(path, timeout=30.0):
    """Wait (bounded) until the actor has created ``path``."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)


@pytest.fixture
def forgotten(monkeypatch):
    """The calls whose answer the client stopped waiting for (a wait that ran out)."""
    dropped = []
    for calls in (Channel, RayCalls):
        real = calls.forget
        monkeypatch.setattr(calls, "forget",
                            lambda self, ticket, real=real: (dropped.append(ticket),
                                                             real(self, ticket))[1])
    return dropped


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
    assert client.channel == (worker is SocketFakeDraftActor)  # the new actor's socket


def test_prefetch_never_waits_nor_queues_behind_a_late_call_and_pause_queues_once(
        ray_local, worker, tmp_path):
    client, _ = make_client(ray_local, worker, timeout=0.2)
    assert client.prefetch([[1, 2, 3], [4]])  # handed over, in order before the next call
    assert client.pause()  # the gate turned drafting off
    assert client.propose(StepRequest([[1, 2, 3]], [1], 0.05)) == [[3]]
    assert client.call("get_prefetched") == [3, 1, "paused"]
    release = tmp_path / "release"
    client.call("hold", str(release))  # the next call runs until the test releases it
    assert client.propose(StepRequest([[1]], [1], 0.05)) is None  # late: still in flight
    assert not client.prefetch([[9]])  # not queued behind a late call
    assert client.pause()  # queued: the actor drops its work once the late call ends
    assert not client.pause()  # ... once
    assert not (tmp_path / "release.done").exists()  # all that while the call was held
    release.touch()
    propose_until(client, want=True)
    assert client.call("get_prefetched") == [3, 1, "paused", "paused"]
    # released by the test: none of the calls above waited for the late one (a wait
    # would have lasted until the hold's own bound ran out)
    assert client.call("held") == ["released"]


def test_a_pause_before_a_lend_waits_for_the_actor_but_a_bounded_while(ray_local, worker,
                                                                        tmp_path, forgotten):
    client, _ = make_client(ray_local, worker, timeout=0.5)
    assert client.propose(StepRequest([[1, 2, 3]], [1], 0.05)) == [[3]]
    # the actor's decode call under way ends when the test releases it, once the
    # pause has reached the actor
    first = tmp_path / "first"
    client.call("hold", str(first))
    releaser = threading.Thread(target=lambda: (wait_for(f"{first}.started"), first.touch()),
                                daemon=True)
    releaser.start()
    assert client.pause(wait_s=HOLD_BOUND_S / 2)
    # it returned once the actor had answered: after the decode call ended, within
    # its bound (no wait ran out)
    assert (tmp_path / "first.done").exists() and forgotten == []
    releaser.join()
    stuck = tmp_path / "stuck"
    client.call("hold", str(stuck))
    assert client.pause(wait_s=0.05)
    # a stuck actor costs the bound at most: it returned with the decode call still
    # under way, and stopped waiting for the answer
    assert not (tmp_path / "stuck.done").exists() and len(forgotten) == 1
    stuck.touch()
    wait_for(f"{stuck}.done")
    assert client.call("held") == ["released", "released"]


def test_a_stalled_actor_costs_one_bounded_wait(ray_local, worker, caplog, tmp_path):
    client, _ = make_client(ray_local, worker, timeout=1.0)
    assert client.propose(StepRequest([[1]], [1], 0.05)) == [[1]]
    release = tmp_path / "release"
    client.call("hold", str(release))  # the actor stalls in the next call
    with caplog.at_level(logging.WARNING, logger="test_client"):
        # the bound, not the stalled call: it returns with the call under way
        assert client.propose(StepRequest([[1]], [1], 0.05)) is None
        assert client.timeouts == 1
        # steps go on without drafts, and without calls while the late one is in
        # flight; past STALL_WARN_S it is logged as a stall
        deadline = time.monotonic() + 30
        while "has not answered for" not in caplog.text and time.monotonic() < deadline:
            assert client.propose(StepRequest([[1]], [1], 0.05)) is None
            time.sleep(0.02)
        assert not (tmp_path / "release.done").exists()  # all that while it was held
        release.touch()
        assert propose_until(client, want=True) == [[3, 3]]  # then drafting resumes
    assert "has not answered for" in caplog.text and "answers again" in caplog.text
    assert client.timeouts == 1 and client.restarts == 0
    # one call before the stall, the stalled one, the one that drafted again: none was
    # sent while the stalled call was in flight, and none waited for it
    assert client.call("propose_calls") == 3 and client.call("held") == ["released"]


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
