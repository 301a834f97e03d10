"""The actor's Unix socket for the step's calls (duo_vllm/runtime/channel.py), without Ray."""

import threading
import time

import pytest

from duo_vllm.runtime.channel import Channel, ChannelServer, RemoteError


class Target:
    def __init__(self):
        self.calls = []
        self.gate = threading.Event()
        self.gate.set()

    def propose(self, contexts, budgets):
        self.gate.wait(30)  # a safety bound: the tests open the gate
        self.calls.append(("propose", len(contexts)))
        return [[len(c)] * b for c, b in zip(contexts, budgets)]

    def prefetch(self, contexts):
        self.calls.append(("prefetch", len(contexts)))
        return len(contexts)

    def pause(self, wait=False):
        raise ValueError("a bug in the drafter")

    def stats(self):
        return {}


@pytest.fixture
def served():
    target = Target()
    server = ChannelServer(target)
    channel = Channel(server.address, server.authkey)
    yield target, server, channel
    channel.close()
    server.close()


def test_calls_are_answered_in_the_order_they_were_sent(served):
    target, _, channel = served
    assert channel.submit("prefetch", [[1], [2]], reply=False) == 1  # nobody answers it
    ticket = channel.submit("propose", [[1, 2, 3]], [2])
    assert channel.get(ticket, timeout=5) == [[3, 3]]
    assert target.calls == [("prefetch", 2), ("propose", 1)]  # the prefetch ran first


def test_a_late_answer_is_kept_until_asked_for(served):
    target, _, channel = served
    target.gate.clear()  # the actor's decode call under way
    late = channel.submit("propose", [[1]], [1])
    assert not channel.ready(late, timeout=0.05)
    target.gate.set()
    nxt = channel.submit("propose", [[1, 2]], [1])
    assert channel.get(nxt, timeout=5) == [[2]]  # read past the late answer, which is kept
    assert channel.ready(late) and channel.get(late) == [[1]]
    target.gate.clear()
    dropped = channel.submit("propose", [[1]], [1])
    assert not channel.ready(dropped, timeout=0.05)
    channel.forget(dropped)  # a wait that ran out: its answer is dropped when it comes
    target.gate.set()
    assert channel.get(channel.submit("propose", [[1]], [1]), timeout=5) == [[1]]
    assert not channel._answers and not channel._dropped


def test_a_call_under_way_never_holds_up_the_next_send(served):
    target, _, channel = served
    target.gate.clear()  # a call that waits out the actor's decode call
    late = channel.submit("propose", [[1]], [1])
    big = [list(range(200_000))]  # past the socket's buffer: read off it as it comes
    sent = threading.Event()
    threading.Thread(target=lambda: (channel.submit("prefetch", big, reply=False),
                                     sent.set()), daemon=True).start()
    # the send completes while the call under way still holds the actor: only the test
    # opens the gate (a send stuck behind the call would end only once the gate's own
    # bound let the call finish, and the call would show in target.calls)
    assert sent.wait(timeout=60)
    assert target.calls == []
    target.gate.set()
    assert channel.get(late, timeout=5) == [[1]]
    assert channel.get(channel.submit("propose", [[1]], [1]), timeout=5) == [[1]]
    assert target.calls[-2:] == [("prefetch", 1), ("propose", 1)]


def test_a_silent_client_does_not_hold_up_the_next(served):
    import socket

    _, server, _ = served
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(server.address)  # connects, never answers the handshake
    try:
        other = Channel(server.address, server.authkey)
        assert other.get(other.submit("propose", [[1, 2]], [1]), timeout=5) == [[2]]
        other.close()
    finally:
        silent.close()


def test_a_raising_method_and_an_unserved_name_are_remote_errors(served):
    _, _, channel = served
    with pytest.raises(RemoteError, match="a bug in the drafter"):
        channel.get(channel.submit("pause", True), timeout=5)
    with pytest.raises(RemoteError, match="not 'stats'"):  # only the step's calls
        channel.get(channel.submit("stats"), timeout=5)
    assert channel.get(channel.submit("propose", [[1]], [1]), timeout=5) == [[1]]  # still up


def test_a_wrong_authkey_is_refused(served):
    _, server, _ = served
    with pytest.raises(Exception):
        Channel(server.address, b"not the key").submit("prefetch", [[1]], reply=False)


def _serve_in_a_process(conn):
    server = ChannelServer(Target())
    conn.send((server.address, server.authkey))
    time.sleep(60)


def test_a_dead_actor_process_is_an_eof_or_os_error():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve_in_a_process, args=(there,), daemon=True)
    proc.start()
    try:
        channel = Channel(*here.recv())
        assert channel.get(channel.submit("propose", [[1]], [1]), timeout=10) == [[1]]
        proc.kill()
        proc.join(10)
        with pytest.raises((EOFError, OSError)):  # ActorClient: the actor is gone
            channel.get(channel.submit("propose", [[1]], [1]), timeout=5)
    finally:
        proc.kill()
