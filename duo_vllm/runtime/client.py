"""The proposer's side of the draft actor: vLLM's step loop never hangs on it.

``propose`` waits at most ``propose_timeout_s`` (:func:`auto_timeout` for ``"auto"``); a
late call is dropped when it lands, steps going without drafts meanwhile. A dead actor is
replaced in the background; after ``max_restarts`` the proposer stays on plain decoding.
The step's calls take a Unix socket (:mod:`~duo_vllm.runtime.channel`) on the actor's
node, else Ray.
"""

from __future__ import annotations

import logging
import time
from contextlib import suppress
from typing import Any, Callable

from duo_vllm.runtime.channel import Channel, RayCalls, RemoteError
from duo_vllm.runtime.message import StepRequest

START_TIMEOUT_S = 300.0  # loading a large GGUF takes a while; a hang does not
AUTO_TIMEOUT_FIRST_S = 1.0  # before the first answer and step have been measured
AUTO_TIMEOUT_MIN_S = 0.02
STEP_FRACTION = 0.5
STALL_WARN_S = 1.0  # a call this late is a stalled actor, worth a warning
RETRY_S = 0.5  # wait before asking Ray again for a replacement actor


def auto_timeout(answer_s: float | None, step_s: float | None, answer_dev_s: float = 0.0) -> float:
    """The bound on one propose() wait: smoothed answer time + 4 deviations + half a step."""
    if answer_s is None or step_s is None:
        return AUTO_TIMEOUT_FIRST_S
    return max(AUTO_TIMEOUT_MIN_S, answer_s + 4 * answer_dev_s + STEP_FRACTION * step_s)


class ActorClient:
    """Calls a draft actor without ever blocking vLLM for long; ``create`` returns its handle."""

    def __init__(self, create: Callable[[], Any], timeout_s: float | str, max_restarts: int,
                 logger: logging.Logger):
        import ray

        self._ray, self._create, self._log = ray, create, logger
        self._timeout = timeout_s
        self.max_restarts = max_restarts
        self.actor = create()
        try:  # start-up errors (bad GGUF, bad cores) surface here
            self.info: dict = ray.get(self.actor.info.remote(), timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"DuoProposer: the draft actor did not start within "
                               f"{START_TIMEOUT_S:.0f}s; see `ray status` for resources it "
                               "may be waiting for") from None
        self.restarts = 0  # replacement actors started
        self.timeouts = 0  # propose() calls that returned no draft because the actor was slow
        self.disabled = False  # gave up: plain decoding for good
        self._pending = None  # a propose() call that missed its bound, still in flight
        self._paused_behind = None  # the late call a pause() was queued behind
        self._starting = None  # info() of a replacement actor, not answered yet
        self._retry_at: float | None = None  # when to ask again for a replacement
        self._answer_s: float | None = None  # usual answer time (EMA)
        self._answer_dev_s = 0.0  # its mean deviation (EMA)
        self._stall_warned = False
        self.channel = False  # the step's calls go over a socket, not through Ray
        self._opening = None  # a replacement actor's open_channel(), not answered yet
        self._calls = self._connect(self._open_channel(self.actor))

    @staticmethod
    def _open_channel(actor):
        """Ask the actor for its socket (a Ray ref), if it serves one."""
        try:
            serves = hasattr(actor, "open_channel")  # a Ray handle names the actor's methods
        except Exception:
            serves = False
        return actor.open_channel.remote() if serves else None

    def _connect(self, opening):
        """The step's calls: the socket of ``opening`` (an open_channel() call) when the
        actor is on this node and it opens, else Ray."""
        self.channel = False
        try:
            here = self._ray.get_runtime_context().get_node_id()
            if self.info.get("node_id") == here and opening is not None:
                address, authkey = self._ray.get(opening, timeout=30)  # at start-up only
                calls, self.channel = Channel(address, authkey), True
                return calls
        except Exception as e:  # Ray's call still works: only slower
            self._log.info("DuoProposer: the draft actor's socket did not open (%s: %s); "
                           "its calls go through Ray", type(e).__name__, e)
        return RayCalls(self._ray, self.actor)

    # blocking calls, off the step path (start-up, stats)

    def call(self, name: str, *args, timeout: float | None = None):
        return self._ray.get(getattr(self.actor, name).remote(*args), timeout=timeout)

    def submit(self, name: str, *args):
        return getattr(self.actor, name).remote(*args)

    def ready(self, ref) -> bool:
        return bool(self._ray.wait([ref], timeout=0)[0])

    def get(self, ref, timeout: float | None = None):
        return self._ray.get(ref, timeout=timeout)

    @property
    def healthy(self) -> bool:
        return not self.disabled and self._starting is None and self._retry_at is None

    def propose(self, step: StepRequest) -> list[list[int]] | None:
        """The actor's drafts for ``step``, or ``None`` when this step must go without."""
        if self.disabled or not self._replacement_ready() or not self._pending_done():
            return None
        timeout = (auto_timeout(self._answer_s, step.step_s, self._answer_dev_s)
                   if self._timeout == "auto" else float(self._timeout))
        t0 = time.perf_counter()
        try:
            ref = self._calls.submit("propose", step)
            if not self._calls.ready(ref, max(0.0, timeout - (time.perf_counter() - t0))):
                self._pending = (ref, t0, timeout)
                self.timeouts += 1
                self._log.debug("DuoProposer: the draft actor did not answer within %.0f ms; "
                                "this step decodes without a draft", 1e3 * timeout)
                return None
            drafts = self._calls.get(ref)
        except Exception as e:
            self._on_error(e)
            return None
        self._observe_answer(time.perf_counter() - t0)
        return drafts

    def prefetch(self, contexts) -> bool:
        """Hand the actor prompts vLLM is about to prefill, ahead of that step's propose();
        never waits, skipped while the actor is unhealthy."""
        if not self.healthy or self._pending is not None:
            return False
        try:
            self._calls.submit("prefetch", contexts, reply=False)
        except Exception:  # the actor is gone: the next propose() finds out and recovers
            return False
        return True

    def pause(self, wait_s: float = 0.0) -> bool:
        """Tell the actor the gate turned drafting off; with ``wait_s``, wait at most that
        long for its cores to go idle. Skipped while unhealthy; behind a late call it is
        queued once, without a wait."""
        if not self.healthy:
            return False
        if self._pending is not None:
            if self._paused_behind is self._pending:  # already queued behind this call
                return False
            self._paused_behind = self._pending
            wait_s = 0.0  # behind a late call: not worth a wait
        try:
            ref = self._calls.submit("pause", wait_s > 0, reply=wait_s > 0)
            if wait_s > 0 and not self._calls.ready(ref, wait_s):
                self._calls.forget(ref)
        except Exception:  # the actor is gone: the next propose() finds out and recovers
            return False
        return True

    def _observe_answer(self, seconds: float) -> None:
        a = self._answer_s
        if a is None:
            self._answer_s, self._answer_dev_s = seconds, seconds / 2
            return
        self._answer_dev_s += 0.25 * (abs(seconds - a) - self._answer_dev_s)
        self._answer_s = a + 0.125 * (seconds - a)

    def _pending_done(self) -> bool:
        """Has the late call landed? (Its drafts are stale and dropped.)"""
        if self._pending is None:
            return True
        ref, t0, bound = self._pending
        try:
            if not self._calls.ready(ref, 0.0):
                late = time.perf_counter() - t0
                if late > STALL_WARN_S and not self._stall_warned:
                    self._stall_warned = True
                    self._log.warning("DuoProposer: the draft actor has not answered for %.1f "
                                      "s (bound %.0f ms); steps decode without a draft until "
                                      "it does", late, 1e3 * bound)
                return False
            self._pending = self._paused_behind = None
            self._calls.get(ref)
        except Exception as e:  # the socket closed (the actor is gone), or the call raised
            self._on_error(e)
            return False
        # a late answer raises the auto bound a little: it counts as 4 bounds at most
        self._observe_answer(min(time.perf_counter() - t0, 4 * bound))
        if self._stall_warned:
            self._stall_warned = False
            self._log.warning("DuoProposer: the draft actor answers again; drafting resumes")
        return True

    def _on_error(self, error: Exception) -> None:
        if not _actor_gone(error):
            # the actor is alive but its method raised: a bug that a retry would repeat
            self.disabled = True
            self._log.error("DuoProposer: the draft actor raised %s: %s; falling back to plain "
                            "decoding for good (output is unaffected, only slower)",
                            type(error).__name__, error)
            return
        self._log.warning("DuoProposer: the draft actor is gone (%s); decoding without drafts "
                          "(output is unaffected) while a new one starts", type(error).__name__)
        self._restart()

    def _restart(self) -> None:
        self._calls.close()
        self._calls, self.channel = RayCalls(self._ray, None), False  # none till it answers
        if self.restarts >= self.max_restarts:
            self.disabled = True
            self._log.error("DuoProposer: the draft actor failed after %d restart(s); plain "
                            "decoding from now on", self.restarts)
            return
        self._pending, self._paused_behind, self._stall_warned = None, None, False
        dead = getattr(self.actor, "_actor_id", None)
        with suppress(Exception):  # a dead named actor keeps its name until killed explicitly
            self._ray.kill(self.actor, no_restart=True)
        try:
            actor = self._create()
        except Exception as e:
            self.disabled = True
            self._log.error("DuoProposer: cannot start a new draft actor (%s: %s); plain "
                            "decoding from now on", type(e).__name__, e)
            return
        if dead is not None and getattr(actor, "_actor_id", None) == dead:
            # Ray has not released the dead actor's name yet: ask again in a moment
            self._retry_at = time.monotonic() + RETRY_S
            return
        self.restarts += 1
        self.actor = actor
        self._starting = actor.info.remote()
        self._opening = self._open_channel(actor)  # in parallel: no step waits for it

    def _replacement_ready(self) -> bool:
        if self._retry_at is not None:
            if time.monotonic() >= self._retry_at:
                self._retry_at = None
                self._restart()
            return False
        if self._starting is None:
            return True
        if not self.ready(self._starting) or (self._opening is not None
                                               and not self.ready(self._opening)):
            return False
        ref, self._starting = self._starting, None
        try:
            self.info = self._ray.get(ref)
        except Exception as e:
            self._log.warning("DuoProposer: the new draft actor failed to start (%s: %s)",
                              type(e).__name__, e)
            self._restart()
            return False
        self._answer_s = None
        self._calls, self._opening = self._connect(self._opening), None
        self._log.warning("DuoProposer: draft actor restarted (pid %d on node %s, restart %d "
                          "of at most %d); drafting resumes", self.info["pid"],
                          self.info["node_id"], self.restarts, self.max_restarts)
        return True


def _actor_gone(error: Exception) -> bool:
    """Did the call fail because the actor's process or Ray failed (worth a restart), not
    because the drafter's code raised (``RayTaskError``, ``RemoteError``: would fail again)?"""
    from ray.exceptions import RayError, RayTaskError

    # first: a RayTaskError is also an instance of the drafter's exception (an OSError, say)
    if isinstance(error, (RemoteError, RayTaskError)):
        return False
    # the socket closed with the actor's process; RayActorError, WorkerCrashedError, ...
    return isinstance(error, (EOFError, OSError, RayError))
