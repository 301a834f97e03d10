"""`vllm serve` (the OpenAI API server) with DuoProposer, against a plain server.

One plain and one DuoProposer server for the whole module; the DuoProposer
one is started by ``duo-vllm serve``, as a user would. Its draft context is
512 tokens (``n_ctx``), less than the target's 2048, so that a long prompt
outgrows the draft but not the target. In order:
single requests, a concurrent load with aborts, a stalled and then a killed
draft actor (a stall that did not recover would fail its own test, not the
next), and bad input. Every completed greedy request must equal plain vLLM's.
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from benchmarks.load import build_requests, compare, latency, run_load
from benchmarks.server import Server

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Give three tips for writing clear Python code."}]
DRAFT_N_CTX = 512
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"


def duo_serve() -> list[str]:
    """``duo-vllm serve``: the console script next to this Python, else its module."""
    script = Path(sys.executable).with_name("duo-vllm")
    return [str(script), "serve"] if script.is_file() else \
        [sys.executable, "-m", "duo_vllm.cli", "serve"]


@pytest.fixture(scope="module")
def servers(target_dir, session_tmp):
    plain = Server(target_dir, session_tmp / "serve_plain.log")
    duo = Server(target_dir, session_tmp / "serve_duo.log",
                 # the fault tests need steps that call the actor: no gate (it could
                 # leave a batch size to plain decoding just then; tests/test_gate.py)
                 launcher=[*duo_serve(), "--num-speculative-tokens", "4",
                           "--duo", json.dumps({"n_ctx": DRAFT_N_CTX, "tuning": {"gate": False}})])
    try:
        plain.wait_ready()
        duo.wait_ready()
        yield plain, duo
    finally:
        plain.stop()
        duo.stop()


def test_chat_streamed_and_not_equal_plain_vllm(servers):
    plain, duo = servers
    want = plain.chat(MESSAGES, max_tokens=64)["texts"]
    assert want[0].strip()
    assert duo.chat(MESSAGES, max_tokens=64)["texts"] == want
    assert duo.chat(MESSAGES, stream=True, max_tokens=64)["texts"] == want
    assert duo.counter(ACCEPTED) > 0
    assert "DuoProposer: draft" in duo.log_text()


def _duo_metrics(server: Server) -> dict:
    out = {}
    for line in server.metrics().splitlines():
        if line.startswith("duo:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_metrics_show_the_draft_statistics(servers):
    """duo:* counters on the server's /metrics (from the engine core, through
    PROMETHEUS_MULTIPROC_DIR, which duo-vllm serve sets); published with each
    stats log line, so at most every 10 s of drafting."""
    _, duo = servers
    wanted = ("duo:steps_total", "duo:returned_tokens_total", "duo:propose_calls_total")
    deadline, got = time.time() + 120, {}
    while time.time() < deadline:
        duo.chat(MESSAGES, max_tokens=32)
        got = _duo_metrics(duo)
        if all(got.get(n, 0) > 0 for n in wanted):
            break
        time.sleep(2)
    assert all(got.get(n, 0) > 0 for n in wanted), got
    assert "duo:busy_fraction" in got and "duo:draft_token_ms" in got
    assert duo.counter(ACCEPTED) > 0  # vLLM's own metrics are still there


def test_sampling_options_keep_plain_output(servers, tokenizer):
    """Greedy requests with the options that change the target's logits (penalties,
    banned words, a minimum length) and with logprobs: vLLM's rejection sampler
    applies them at every draft position, so the tokens equal plain vLLM's, and so
    do the logprobs it reports for them. vLLM refuses ``logit_bias`` and ``min_p``
    with any speculative decoding (README, Limits): a 400 that names them."""
    plain, duo = servers
    shaped = {"model": plain.model, "messages": MESSAGES, "max_tokens": 48,
              "temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.4,
              "presence_penalty": 0.3, "bad_words": [" Python"],
              "logprobs": True, "top_logprobs": 3}
    (s1, b1), (s2, b2) = _both(servers, "/v1/chat/completions", json=shaped)
    assert s1 == s2 == 200, (b1, b2)
    assert _texts(b1) == _texts(b2) and _texts(b1)[0].strip()
    want, got = (b["choices"][0]["logprobs"]["content"] for b in (b1, b2))
    assert [t["token"] for t in got] == [t["token"] for t in want]
    assert " Python" not in [t["token"] for t in want]
    for w, g in zip(want, got):
        assert abs(w["logprob"] - g["logprob"]) < 1e-3, (w, g)
        assert [t["token"] for t in g["top_logprobs"]] == [t["token"] for t in w["top_logprobs"]]
    longer = {"model": plain.model, "max_tokens": 40, "temperature": 0.0, "min_tokens": 40,
              "messages": [{"role": "user", "content": "Say hi."}]}
    (s1, b1), (s2, b2) = _both(servers, "/v1/chat/completions", json=longer)
    assert s1 == s2 == 200 and _texts(b1) == _texts(b2)
    assert b1["usage"]["completion_tokens"] == b2["usage"]["completion_tokens"] == 40
    banned = tokenizer.encode(" Python", add_special_tokens=False)[0]
    biased = dict(longer, min_tokens=0, max_tokens=8, logit_bias={str(banned): -100})
    (s1, _), (s2, b2) = _both(servers, "/v1/chat/completions", json=biased)
    assert s1 == 200 and s2 == 400 and "logit_bias" in json.dumps(b2), b2
    assert duo.counter(ACCEPTED) > 0



def test_a_seeded_sampled_request_gets_plain_vllms_tokens_every_run(servers):
    """vLLM's rejection sampler draws from a seeded request's generator once per draft
    token, and how many tokens a step drafts depends on timing: DuoProposer leaves a
    seeded sampled request undrafted (``draft_seeded``), so its seed gives the tokens
    plain vLLM gives, every time."""
    plain, duo = servers
    seeded = dict(max_tokens=48, temperature=0.9, seed=11)
    want = plain.chat(MESSAGES, **seeded)["texts"]
    assert _settled(duo)
    time.sleep(1)  # the last request's step statistics are published
    drafts = duo.counter(DRAFTS)
    assert duo.chat(MESSAGES, **seeded)["texts"] == want
    assert duo.chat(MESSAGES, stream=True, **seeded)["texts"] == want
    assert duo.counter(DRAFTS) == drafts  # no draft was verified for them
    duo.chat(MESSAGES, max_tokens=48, temperature=0.9)  # unseeded: drafted
    assert duo.counter(DRAFTS) > drafts

def _settled(server: Server, timeout: float = 60) -> bool:
    """No request left running or waiting (aborted streams were cleaned up)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.counter("vllm:num_requests_running") + \
                server.counter("vllm:num_requests_waiting") == 0:
            return True
        time.sleep(1)
    return False


def test_concurrent_load_with_aborts_matches_plain(servers):
    """32 concurrent requests: streamed or not, stop strings, n=2, some closed mid-stream."""
    from tests.support.specbench import load_specbench

    plain, duo = servers
    prompts = [p for _, p in load_specbench(per_task=2)]
    reqs = build_requests(prompts, 32)
    assert sum(r.abort_after is not None for r in reqs) >= 4 and any(r.n == 2 for r in reqs)
    accepted_before = duo.counter(ACCEPTED)
    ref = run_load(plain.url, plain.model, reqs)
    got = run_load(duo.url, duo.model, reqs)
    assert compare(reqs, ref, got) == []
    done = [r for r in got if not r.aborted]
    assert len(done) == len(reqs) - sum(r.abort_after is not None for r in reqs)
    # stop strings took effect (the same way as plain, checked above)
    assert any(f == "stop" for r, q in zip(done, reqs) if q.stop for f in r.finish)
    assert _settled(plain) and _settled(duo) and plain.healthy() and duo.healthy()
    assert duo.counter(ACCEPTED) > accepted_before
    print(f"\nload latency: plain {latency(ref)}, duo {latency(got)}")


FAULT_PROMPTS = ["Write a short story about a robot learning to paint.",
                 "Explain how a bicycle stays upright.",
                 "List ten fruits and one fact about each."]


def _in_flight(server: Server, results: dict):
    def one(i, prompt):
        results[i] = server.chat([{"role": "user", "content": prompt}], stream=True,
                                 max_tokens=96)["texts"]

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(FAULT_PROMPTS)]
    for t in threads:
        t.start()
    return threads


def _plain_answers(plain: Server) -> dict:
    return {i: plain.chat([{"role": "user", "content": p}], max_tokens=96)["texts"]
            for i, p in enumerate(FAULT_PROMPTS)}


def _drafting_resumes(duo: Server, log_line: str, timeout: float = 120) -> None:
    """Send requests until ``log_line`` is logged and drafts are accepted again."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        before = duo.counter(ACCEPTED)
        duo.chat(MESSAGES, max_tokens=32)
        if log_line in duo.log_text() and duo.counter(ACCEPTED) > before:
            return
        time.sleep(1)
    # what the draft side said, for a failure that shows only on another machine
    said = [line[-300:] for line in duo.log_text().splitlines() if "DuoProposer" in line]
    raise AssertionError(f"drafting did not resume ({log_line!r} logged: "
                         f"{log_line in duo.log_text()}); the draft side's log:\n"
                         + "\n".join(said[-25:]))


def test_stalled_draft_actor_costs_a_bounded_wait(servers):
    plain, duo = servers
    want = _plain_answers(plain)
    pid = duo.draft_actor_pid()
    got: dict = {}
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.time()
        threads = _in_flight(duo, got)
        for t in threads:
            t.join(timeout=120)
        stalled_for = time.time() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert got == want, stalled_for  # plain decoding while the actor was stopped
    assert "has not answered for" in duo.log_text()
    _drafting_resumes(duo, "draft actor answers again")
    assert duo.draft_actor_pid() == pid  # a stall is not a death: no restart


def test_killed_draft_actor_falls_back_restarts_and_resumes(servers):
    plain, duo = servers
    want = _plain_answers(plain)
    pid = duo.draft_actor_pid()
    assert pid is not None
    got: dict = {}
    threads = _in_flight(duo, got)
    time.sleep(1.0)  # generating
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    assert got == want  # in-flight requests completed, and correctly
    assert "draft actor is gone" in duo.log_text()
    _drafting_resumes(duo, "draft actor restarted")
    assert "restart 1 of at most 3" in duo.log_text()  # the first replacement came up
    assert duo.draft_actor_pid() not in (None, pid)
    assert duo.healthy()


# --- bad input: the same answer as plain vLLM, and a healthy server -------------------------

def _both(servers, path: str, **kwargs):
    out = []
    for s in servers:
        r = requests.post(s.url + path, timeout=300, **kwargs)
        out.append((r.status_code, r.json() if r.headers.get("content-type", "").startswith(
            "application/json") else r.text))
    assert all(s.healthy() for s in servers)
    return out


def _texts(body):
    return [c.get("text", c.get("message", {}).get("content")) for c in body["choices"]]


def test_empty_prompt(servers):
    plain, duo = servers
    chat = {"model": plain.model, "messages": [{"role": "user", "content": ""}],
            "max_tokens": 24, "temperature": 0.0}
    (s1, b1), (s2, b2) = _both(servers, "/v1/chat/completions", json=chat)
    assert s1 == s2 == 200 and _texts(b1) == _texts(b2)
    comp = {"model": plain.model, "prompt": "", "max_tokens": 8, "temperature": 0.0}
    (s1, b1), (s2, b2) = _both(servers, "/v1/completions", json=comp)
    assert s1 == s2
    if s1 == 200:
        assert _texts(b1) == _texts(b2)


def test_non_utf8_bytes(servers):
    plain, _ = servers
    raw = (b'{"model": "' + plain.model.encode() + b'", "max_tokens": 8, '
           b'"messages": [{"role": "user", "content": "caf\xe9 \xff\xfe bytes"}]}')
    (s1, _), (s2, _) = _both(servers, "/v1/chat/completions", data=raw,
                             headers={"content-type": "application/json"})
    assert s1 == s2 and 400 <= s1 < 500
    # valid JSON, but a lone surrogate: not encodable as UTF-8
    body = ('{"model": "%s", "max_tokens": 8, "temperature": 0, '
            '"messages": [{"role": "user", "content": "half a pair \\udcff here"}]}'
            % plain.model)
    (s1, b1), (s2, b2) = _both(servers, "/v1/chat/completions", data=body.encode(),
                               headers={"content-type": "application/json"})
    assert s1 == s2
    if s1 == 200:
        assert _texts(b1) == _texts(b2)


def test_prompt_longer_than_the_draft_context(servers, tokenizer):
    plain, duo = servers
    text = " ".join(f"Fact {i}: the number {i} follows {i - 1}." for i in range(1, 120))
    assert DRAFT_N_CTX < len(tokenizer.encode(text)) < plain.max_model_len - 64
    messages = [{"role": "user", "content": text + " What comes next?"}]
    want = plain.chat(messages, max_tokens=32)["texts"]
    assert duo.chat(messages, max_tokens=32)["texts"] == want
    assert duo.chat(messages, stream=True, max_tokens=32)["texts"] == want
    assert duo.healthy()


def test_requests_at_max_model_len(servers, tokenizer):
    plain, _ = servers
    ids = tokenizer.encode(" the quick brown fox jumps over the lazy dog.")
    prompt = (ids * (plain.max_model_len // len(ids) + 1))[: plain.max_model_len - 8]
    fits = {"model": plain.model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    (s1, b1), (s2, b2) = _both(servers, "/v1/completions", json=fits)
    assert s1 == s2 == 200 and _texts(b1) == _texts(b2)
    assert b1["usage"]["prompt_tokens"] + b1["usage"]["completion_tokens"] <= plain.max_model_len
    too_long = dict(fits, max_tokens=9)
    (s1, b1), (s2, b2) = _both(servers, "/v1/completions", json=too_long)
    assert s1 == s2
    if s1 == 200:
        assert _texts(b1) == _texts(b2)
