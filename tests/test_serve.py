"""`vllm serve` (the OpenAI API server) with DuoProposer, against a plain server."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import requests

from duo_vllm.cli import speculative_config
from tests.conftest import E2E_ENV

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Give three tips for writing clear Python code."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 (what `vllm serve` runs)."""

    def __init__(self, target, log_path, spec=None):
        self.port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
               "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "2048",
               "--seed", "0", "--dtype", "float32"]
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **E2E_ENV}, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = target

    def wait_ready(self, timeout=600):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited early:\n{open(self.log_path).read()[-4000:]}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise AssertionError("server did not become ready in time")

    def chat(self, stream: bool, max_tokens=64) -> str:
        body = {"model": self.model, "messages": MESSAGES, "max_tokens": max_tokens,
                "temperature": 0.0, "stream": stream}
        r = requests.post(self.url + "/v1/chat/completions", json=body, stream=stream,
                          timeout=300)
        r.raise_for_status()
        if not stream:
            return r.json()["choices"][0]["message"]["content"]
        parts = []
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[len("data: "):])["choices"][0]["delta"]
            parts.append(delta.get("content") or "")
        return "".join(parts)

    def metrics(self) -> str:
        return requests.get(self.url + "/metrics", timeout=10).text

    def stop(self):
        try:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, 9)
        self.log.close()


@pytest.fixture(scope="module")
def servers(target_dir, session_tmp):
    plain = Server(target_dir, session_tmp / "serve_plain.log")
    duo = Server(target_dir, session_tmp / "serve_duo.log", spec=speculative_config(4))
    try:
        plain.wait_ready()
        duo.wait_ready()
        yield plain, duo
    finally:
        plain.stop()
        duo.stop()


def _counter(metrics_text: str, name: str) -> float:
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_chat_streamed_and_not_equal_plain_vllm(servers):
    plain, duo = servers
    want = plain.chat(stream=False)
    assert want.strip()
    assert duo.chat(stream=False) == want
    assert duo.chat(stream=True) == want
    metrics = duo.metrics()
    assert _counter(metrics, "vllm:spec_decode_num_accepted_tokens_total") > 0
    assert "DuoProposer: draft" in open(duo.log_path).read()
