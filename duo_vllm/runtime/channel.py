"""A same-node draft actor's step calls over a Unix socket, cheaper than a Ray call.

The socket (in Linux's abstract namespace, so a killed actor leaves no file; elsewhere in
a private 0700 directory) is guarded by an authkey handed over through Ray, which still
starts and restarts the actor and carries the calls off the step path. The step's calls
all take the socket, so they keep their order. ``submit`` returns a ticket for
``ready``/``get``; ``reply=False``: no answer.
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import sys
import tempfile
import threading
import time
from contextlib import suppress
from multiprocessing.connection import Client, Listener, answer_challenge, deliver_challenge

STEP_METHODS = ("propose", "prefetch", "pause")  # what the socket serves


class RemoteError(Exception):
    """The actor's method raised (a bug in the drafter, not a lost actor)."""


class NoAnswer(Exception):
    """No answer within the wait (not an OSError: the actor is not known to be gone)."""


class ChannelServer:
    """The actor's end: serves the step's methods of ``target``, one call at a time (as a
    Ray actor with ``max_concurrency=1``). Each connection has a reader thread, so sends
    never wait on a call under way, and a thread that does the handshake and runs the
    calls in order (a silent client stalls no one else)."""

    def __init__(self, target):
        self._target = target
        self._lock = threading.Lock()  # one call at a time, whichever connection
        if sys.platform.startswith("linux"):
            self._dir, self.address = None, f"\0duo-vllm-{os.getpid()}-{os.urandom(8).hex()}"
        else:
            self._dir = tempfile.mkdtemp(prefix="duo-vllm-")  # 0700: this user only
            self.address = os.path.join(self._dir, "step.sock")
        self.authkey = os.urandom(16)
        self._listener = Listener(self.address, family="AF_UNIX")  # handshake: _serve
        self._closed = False
        threading.Thread(target=self._accept, name="duo-channel", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:
                if self._closed:
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), name="duo-channel-conn",
                             daemon=True).start()

    def _serve(self, conn) -> None:
        with conn:
            try:  # what Listener(authkey=...).accept() does, in this connection's thread
                deliver_challenge(conn, self.authkey)
                answer_challenge(conn, self.authkey)
            except Exception:  # a wrong key, or a client that went away
                return
            calls: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=self._read, args=(conn, calls), name="duo-channel-read",
                             daemon=True).start()
            while True:
                call = calls.get()
                if call is None:  # the proposer went away
                    return
                seq, name, args, reply = call
                try:
                    if name not in STEP_METHODS:
                        raise AttributeError(f"the channel serves {sorted(STEP_METHODS)}, "
                                             f"not {name!r}")
                    with self._lock:
                        value, ok = getattr(self._target, name)(*args), True
                except Exception as e:
                    value, ok = f"{type(e).__name__}: {e}", False
                if reply and not self._answer(conn, seq, ok, value):
                    return

    @staticmethod
    def _read(conn, calls) -> None:
        try:
            while True:
                calls.put(conn.recv())
        except Exception:  # EOF (the proposer went away), or a message that does not unpickle
            calls.put(None)

    @staticmethod
    def _answer(conn, seq, ok, value) -> bool:
        try:
            conn.send((seq, ok, value))
        except (EOFError, OSError):
            return False
        except Exception as e:  # an answer that does not pickle: a bug, not a lost actor
            return ChannelServer._answer(conn, seq, False, f"{type(e).__name__}: {e}")
        return True

    def close(self) -> None:
        self._closed = True
        with suppress(Exception):
            self._listener._listener._socket.shutdown(socket.SHUT_RDWR)  # wakes accept()
        try:
            self._listener.close()
        finally:
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)


class Channel:
    """The proposer's end. Raises ``EOFError``/``OSError`` when the actor is gone and
    :class:`RemoteError` when its method raised."""

    def __init__(self, address: str, authkey: bytes):
        self._conn = Client(address, family="AF_UNIX", authkey=authkey)
        self._seq = 0
        self._answers: dict[int, tuple[bool, object]] = {}
        self._dropped: set[int] = set()  # calls whose answers no one will ask for

    def submit(self, name: str, *args, reply: bool = True) -> int:
        self._seq += 1
        self._conn.send((self._seq, name, args, reply))
        return self._seq

    def ready(self, ticket: int, timeout: float | None = 0.0) -> bool:
        """Has the call's answer come (waiting up to ``timeout`` s; None: for good)?"""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while ticket not in self._answers:
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if not self._conn.poll(left):
                return False
            seq, ok, value = self._conn.recv()
            if seq in self._dropped:
                self._dropped.discard(seq)
            else:
                self._answers[seq] = (ok, value)
        return True

    def get(self, ticket: int, timeout: float | None = None):
        if not self.ready(ticket, timeout):
            raise NoAnswer(f"no answer to call {ticket} within {timeout} s")
        ok, value = self._answers.pop(ticket)
        if not ok:
            raise RemoteError(value)
        return value

    def forget(self, ticket: int) -> None:
        """No one will ask for this call's answer (a wait that ran out): drop it."""
        if self._answers.pop(ticket, None) is None:
            self._dropped.add(ticket)

    def close(self) -> None:
        self._conn.close()


class RayCalls:
    """The same calls through Ray (another node, or no socket)."""

    def __init__(self, ray, actor):
        self._ray, self._actor = ray, actor

    def submit(self, name: str, *args, reply: bool = True):
        return getattr(self._actor, name).remote(*args)

    def ready(self, ref, timeout: float | None = 0.0) -> bool:
        return bool(self._ray.wait([ref], timeout=timeout)[0])

    def get(self, ref, timeout: float | None = None):
        return self._ray.get(ref, timeout=timeout)

    def forget(self, ref) -> None:
        pass

    def close(self) -> None:
        pass
