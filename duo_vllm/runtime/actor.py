"""The draft actor: the drafter in a process of its own, pinned to CPU cores.

:class:`DraftWorker` runs in-process (``use_actor`` off, tests) or as the named Ray actor
of :func:`get_or_create_actor`. Each ``propose`` answers a vLLM step, then a background
thread pre-drafts the next step until the next call interrupts it between decode calls.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import suppress

from duo_vllm.runtime.channel import ChannelServer
from duo_vllm.config import (DuoConfig, DuoConfigError, allowed_cpus, choose_cores, nest_tuning,
                             read_host)
from duo_vllm.control.drafting import PRIOR_STEP_S, PRIOR_TOKEN_S, step_patience
from duo_vllm.runtime.delta import Delta, DeltaReceiver, Drafts
from duo_vllm.runtime.message import StepRequest
from duo_vllm.draft.drafter import DraftPolicy, DuoDrafter
from duo_vllm.host.cores import draft_threads

logger = logging.getLogger(__name__)


def pin_process(cores: list[int]) -> list[int]:
    """Pin every thread of this process to ``cores`` (a Ray actor's gRPC and core-worker
    threads too: ``sched_setaffinity(0)`` pins the caller only); a readable error if impossible."""
    allowed = allowed_cpus()
    missing = [c for c in cores if c not in allowed]
    if missing:
        raise DuoConfigError(f"draft_cores {cores} name CPU(s) {missing} that do not exist "
                             f"on this node (allowed CPUs: {allowed})")
    os.sched_setaffinity(0, cores)
    if os.path.isdir("/proc/self/task"):
        each_thread(lambda tid: os.sched_setaffinity(tid, cores), ignore=OSError)
    return sorted(os.sched_getaffinity(0))


def each_thread(call, pid: int | str = "self", ignore=ProcessLookupError) -> int:
    """``call(tid)`` for every thread of process ``pid`` (Linux /proc); a call that raises
    ``ignore`` (by default: the thread ended meanwhile) is skipped. Returns the calls made."""
    done = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with suppress(ignore):
            call(int(tid))
            done += 1
    return done


def foreground() -> bool:
    """Every thread of this process under the normal policy again, if it inherited
    ``SCHED_IDLE`` from a raylet kept in the background (a replacement actor); False, and
    a warning, where Linux refuses (no CAP_SYS_NICE): the draft then runs only on idle cores."""
    if not hasattr(os, "SCHED_IDLE") or os.sched_getscheduler(0) != os.SCHED_IDLE:
        return True
    try:
        each_thread(lambda tid: os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0)))
    except PermissionError:
        logger.warning("DuoProposer: the draft actor inherited SCHED_IDLE from Ray's raylet "
                       "and may not leave it (no CAP_SYS_NICE): it drafts only on idle cores")
        return False
    return True


class DraftWorker:
    """Loads the draft model; drafts for vLLM steps and pre-drafts between them."""

    def __init__(self, cfg: dict, model_path: str, cores: list[int] | None, k: int,
                 backend_factory=None):
        config = DuoConfig.from_dict(nest_tuning(cfg))
        self.cores = pin_process(cores) if cores else sorted(os.sched_getaffinity(0))
        n_threads, too_many = draft_threads(config.n_threads, len(self.cores))
        if too_many:
            logger.warning("DuoProposer: %s", too_many)
        policy = DraftPolicy(k=k, parallel=config.parallel, multi_sequence=config.multi_sequence,
                             budget=config.fixed_budget(), max_branches=config.max_branches,
                             sampled_drafts=config.sampled_drafts,
                             vocab_limit=config.target_vocab_size())
        room = policy.max_branches * (k + 2)  # the branches' own tokens, per request
        self.limits = None

        def size(n_ctx_train: int) -> tuple[int, int]:
            """llama.cpp's context (cells, sequences) for the model's training context."""
            self.limits = config.draft_limits(n_ctx_train, policy.max_branches)
            rows = self.limits.max_sequences
            return rows * (self.limits.n_ctx + room), rows * policy.max_branches

        self.draft_file = model_path
        if backend_factory is None:
            from duo_vllm.draft.backend import LlamaCppBackend
            from duo_vllm.models import prepare_draft

            self.draft_file = prepare_draft(model_path, config.draft_quant, log=logger.info)
            self.backend = LlamaCppBackend(self.draft_file, n_ctx=None, n_seq=None,
                                           n_threads=n_threads, size=size,
                                           n_gpu_layers=config.draft_gpu_layers)
        else:
            self.backend = backend_factory(config)
        if self.limits is None:  # a backend that did not ask (tests)
            size(getattr(self.backend, "n_ctx_train", 0))
        for warning in self.limits.warnings:
            logger.warning("DuoProposer: %s", warning)
        for note in self.limits.notes:
            logger.info("DuoProposer: %s", note)
        self.drafter = DuoDrafter(self.backend, self.limits.max_sequences, self.limits.n_ctx,
                                  policy, window=config.draft_window or None,
                                  cache_bytes=config.prompt_cache_mb << 20)
        try:
            logger.info("DuoProposer: draft call ms by width %s", {
                w: round(1e3 * d, 1) for w, d in self.drafter.calibrate().items()})
        except Exception as e:  # the requests' own calls measure D(w) then
            logger.warning("DuoProposer: could not time the draft's calls at start-up: %r", e)
        self.model_path, self.n_threads, self.k = model_path, n_threads, k
        self._lock = threading.Lock()  # the drafter and the llama.cpp context
        self._state = threading.Lock()  # _waiting and _stash
        self._waiting = 0  # propose() calls waiting for the drafter
        self._stash = None  # the StepRequest of a step that could not wait for the drafter
        self._prompts: list = []  # prompts vLLM is prefilling, for the background thread
        self._paused = False  # the gate turned drafting off: no background work till a call
        self._contexts = DeltaReceiver()  # the contexts of the last step, per request
        self._lock_wait_s, self._proposes = 0.0, 0  # steps' waits for a decode under way
        self._handler_s = 0.0  # time inside propose(): the part of vLLM's wait spent here
        self._pause_waits, self._pause_wait_s = 0, 0.0  # lends' waits for a decode under way
        self._wake = threading.Event()
        self._closed = False
        self._deadline = None
        self._channel: ChannelServer | None = None
        self._thread = None
        if policy.parallel:
            self._thread = threading.Thread(target=self._predraft_loop, name="duo-predraft",
                                            daemon=True)
            self._thread.start()

    def info(self) -> dict:
        return {
            "pid": os.getpid(),
            "node": os.uname().nodename,
            "node_id": _ray_node_id(),
            "model": self.model_path,
            "draft_file": self.draft_file,  # what llama.cpp runs (draft_quant)
            "n_vocab": self.backend.n_vocab,
            "cores": self.cores,
            "n_threads": self.n_threads,
            "k": self.k,
            "n_ctx": self.limits.n_ctx,  # per request (derive_draft_limits)
            "max_sequences": self.limits.max_sequences,
            "policy": self.drafter.policy.__dict__,
        }

    def token_texts(self) -> list[str]:
        return self.backend.token_texts()

    def propose(self, step: StepRequest) -> list[list[int]]:
        """Drafts for one vLLM step (:meth:`DuoDrafter.propose`). ``step.contexts`` is full
        contexts or a :class:`Delta`; rows it cannot decode get no draft, named in
        :attr:`Drafts.resend`. A decode under way is waited for only within
        :func:`step_patience`; otherwise the step goes without a draft and its contexts
        are left to the background thread: vLLM never waits on a long prefill."""
        t_in = time.perf_counter()
        try:
            return self._propose_delta(step)
        finally:
            self._handler_s += time.perf_counter() - t_in

    def _propose_delta(self, step: StepRequest):
        if not isinstance(step.contexts, Delta):
            return self._propose(step)
        # decoded before anything else, stash or not: the next step's delta builds on it
        full, resend = self._contexts.decode(step.contexts)
        rows = [i for i, c in enumerate(full) if c is not None]
        drafts: list = [[] for _ in full]
        qs: list = [None] * len(full)
        idle = False
        if rows:
            got = self._propose(step.select(rows, [full[i] for i in rows]))
            idle = getattr(got, "idle", False)
            for j, (i, d) in enumerate(zip(rows, got)):
                drafts[i] = d
                qs[i] = got.q[j] if isinstance(got, Drafts) and got.q else None
        if not any(q is not None for q in qs):
            qs = None
        return Drafts(drafts, resend, qs, idle) if resend or qs or idle else drafts

    def _propose(self, step: StepRequest) -> list[list[int]]:
        with self._state:
            self._waiting += 1
            self._paused = False
        # how long this step may wait for a decode call under way
        patience = step_patience(self.drafter.token_s.get(PRIOR_TOKEN_S),
                                 self.drafter.busy_until - time.perf_counter(),
                                 step.step_s or self.drafter.target_step_s or PRIOR_STEP_S)
        t0 = time.perf_counter()
        got = self._lock.acquire(timeout=patience) if self._thread else self._lock.acquire()
        self._lock_wait_s += time.perf_counter() - t0
        self._proposes += 1
        with self._state:
            self._waiting -= 1
            if not got:
                self._stash = step
                self.drafter.stats.skipped_busy += 1
        if not got:
            self._wake.set()
            return [[] for _ in step.contexts]
        try:
            with self._state:
                self._stash = None  # superseded by this step
            drafts = self.drafter.propose(step)
            drawn = any(q is not None for q in self.drafter.last_q)
            idle = self._idle()
            if drawn or idle:  # drawn: with their q; idle: the cores are free for the step
                drafts = Drafts(drafts, q=self.drafter.last_q if drawn else None, idle=idle)
            self._deadline = self.drafter.deadline_after(time.perf_counter())
        finally:
            self._lock.release()
        if self._thread is not None:
            self._wake.set()
        return drafts

    def _idle(self) -> bool:
        """Nothing queued for the background thread: the cores idle till the next step."""
        with self._state:
            return not self.drafter.jobs and not self._prompts and self._stash is None

    def prefetch(self, contexts) -> int:
        """Prompts vLLM is about to prefill, for the background thread; returns at once with
        the number accepted (0 in serial mode)."""
        if self._thread is None:
            return 0
        with self._state:
            self._prompts = (self._prompts + list(contexts))[-self.limits.max_sequences:]
            self._paused = False
        self._wake.set()
        return len(contexts)

    def pause(self, wait: bool = False) -> None:
        """The gate turned drafting off: drop the queued background work so the draft's
        cores idle. With ``wait``, return once a decode under way has ended (the target is
        about to run on these cores). The next propose() or prefetch() resumes."""
        with self._state:
            self._prompts, self._stash = [], None
            self._paused = True
        if wait:
            t0 = time.perf_counter()
            with self._lock:  # the background thread holds it for its decode calls
                pass
            self._pause_waits += 1
            self._pause_wait_s += time.perf_counter() - t0

    def _interrupted(self) -> bool:
        """A step is waiting for the drafter, or has left newer contexts."""
        return self._waiting > 0 or self._stash is not None or self._paused

    def _predraft_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            while self._waiting == 0 and not self._closed:
                with self._lock:
                    with self._state:
                        stash, self._stash = self._stash, None
                        prompts, self._prompts = self._prompts, []
                    if stash is not None:  # a step that went without a draft
                        self.drafter.propose(stash, serve=False)
                        self._deadline = None
                    if prompts and self.drafter.prefetch(prompts):
                        self._deadline = None  # the target's prefill is no step
                    if self._paused:
                        self.drafter.jobs = []
                    if not self.drafter.jobs:
                        break
                    self.drafter.predraft(self._interrupted, self._deadline)
                if self._stash is None:
                    break

    def stats(self) -> dict:
        """Read without the drafter's lock, which a background prefill may hold while the
        next step's propose() queues behind this call; counters may be a step apart."""
        for _ in range(5):
            try:
                return self._stats()
            except RuntimeError:  # a dict changed size while read: read again
                continue
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        out = self.drafter.stats.as_dict()
        out["draft_token_ms"] = 1e3 * self.drafter.token_s.get(float("nan"))
        out["draft_prefill_token_ms"] = 1e3 * self.drafter.prefill_s.get(float("nan"))
        out["lock_wait_ms"] = 1e3 * self._lock_wait_s / max(1, self._proposes)
        out["actor_propose_ms"] = 1e3 * self._handler_s / max(1, self._proposes)
        out["pause_waits"] = self._pause_waits  # a lend waiting for the draft's cores
        out["pause_wait_s"] = self._pause_wait_s
        out["target_step_ms"] = 1e3 * (self.drafter.target_step_s or float("nan"))
        out["verify_token_ms"] = 1e3 * (self.drafter.per_token_s or float("nan"))
        out["draft_call_ms_by_width"] = {w: 1e3 * s for w, s in
                                         self.drafter.draft_time.table().items()}
        cache = self.drafter.cache
        out["cache_mb"] = 0.0 if cache is None else cache.bytes / 2 ** 20  # a gauge (float)
        acc = self.drafter.acceptance
        out["acceptance_greedy"] = acc.regime_alpha("greedy")
        out["acceptance_sampled"] = acc.regime_alpha("sampled")
        return out

    def open_channel(self) -> tuple[str, bytes]:
        """(address, authkey) of a Unix socket for the step's calls from this node; its
        threads start from this one, so they run on the draft's cores."""
        if self._channel is None:
            self._channel = ChannelServer(self)
        return self._channel.address, self._channel.authkey

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._channel is not None:
            self._channel.close()
            self._channel = None


class DraftActor(DraftWorker):
    """DraftWorker as the Ray actor, logging in vLLM's format; without cores from the
    proposer (placed by ``resources``), it chooses cores of the node it runs on."""

    def __init__(self, cfg: dict, model_path: str, cores: list[int] | None, k: int,
                 backend_factory=None):
        from duo_vllm.logs import setup_actor_logging

        setup_actor_logging()
        foreground()
        if not cores:
            cores = node_draft_cores(DuoConfig.from_dict(nest_tuning(cfg)))
        super().__init__(cfg, model_path, cores, k, backend_factory)


def node_draft_cores(config: DuoConfig, available: list[int] | None = None,
                     environ: dict | None = None, host=None) -> list[int]:
    """The draft's cores chosen on the actor's node (no GPU lookup: a remote node's GPU is
    not vLLM's), logged."""
    available = allowed_cpus() if available is None else available
    host = read_host(available, gpu=False) if host is None else host
    choice = choose_cores(config, available, os.environ if environ is None else environ, host)
    threads, _ = draft_threads(config.n_threads, len(choice.cores))
    logger.info("DuoProposer: draft cores %s on node %s, %d llama.cpp thread(s): %s",
                choice.cores, os.uname().nodename, threads, choice.reason)
    return choice.cores


def _ray_node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        return None


def get_or_create_actor(config: DuoConfig, model_path: str, cores: list[int] | None, k: int):
    """Create the named draft actor, or attach to it if it runs; ``config.resources`` place
    it. It takes no CPU from Ray's accounting since it pins itself."""
    import ray

    actor_cls = ray.remote(num_cpus=0, max_concurrency=1)(DraftActor)
    return actor_cls.options(**actor_options(config)).remote(config.to_dict(), model_path,
                                                             cores, k)


# what hides every GPU from a process, for the CUDA, ROCm and Vulkan builds of llama.cpp
NO_GPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "",
              "ROCR_VISIBLE_DEVICES": "", "GGML_VK_VISIBLE_DEVICES": ""}


def actor_options(config: DuoConfig) -> dict:
    """Ray options of the draft actor: its name, placement, and no GPU unless asked for."""
    opts = dict(name=config.actor_name, namespace=config.namespace, get_if_exists=True,
                resources=dict(config.resources or {}))
    if config.draft_gpu_layers == 0:  # Ray no longer hides GPUs from actors that ask for none
        opts["runtime_env"] = {"env_vars": dict(NO_GPU_ENV)}
    return opts
