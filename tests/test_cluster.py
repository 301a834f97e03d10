"""The draft actor on another node of a Ray cluster, placed by a custom resource.

A two-node cluster on this machine, on loopback: a head node (where vLLM's
process joins as a driver) and a worker node started with the custom resource
``{"duo_draft": 1}``. Both run with Ray's token authentication and a marker in
their environment; teardown kills exactly the processes that carry it, so no
other Ray instance on the machine is touched.
"""

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from benchmarks.server import free_port
from duo_vllm.cli import speculative_config
from tests.support.engines import E2E_ENV, run_vllm

pytestmark = pytest.mark.e2e

RAY = str(Path(sys.executable).with_name("ray"))
MARKER = "DUO_TEST_CLUSTER"
LIFETIME_S = 900  # the cluster is torn down after this even if the test hangs


def _marked_pids(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"{MARKER}={marker}".encode() in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = ["--block", "--node-ip-address=127.0.0.1", "--num-cpus=1",
              "--object-store-memory=100000000", "--disable-usage-stats"]
    logs = tmp_path_factory.mktemp("ray_cluster")
    procs = []
    try:
        for name, args in (("head", ["--head", f"--port={port}", "--include-dashboard=false"]),
                           ("worker", [f"--address={address}",
                                       "--resources=" + json.dumps({"duo_draft": 1})])):
            log = open(logs / f"{name}.log", "w")
            procs.append(subprocess.Popen(["timeout", str(LIFETIME_S), RAY, "start", *args,
                                           *common], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
            _wait_nodes(env, address, want=len(procs), logs=logs)
        yield {"address": address, "env": env, "nodes": _nodes(env, address)}
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        time.sleep(3)
        for pid in _marked_pids(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


NODES_SCRIPT = """
import json, ray
ray.init(address={address!r}, logging_level="ERROR")
print("NODES " + json.dumps([{{"id": n["NodeID"], "alive": n["Alive"],
                               "resources": n["Resources"]}} for n in ray.nodes()]))
"""


def _nodes(env, address):
    out = subprocess.run([sys.executable, "-c", NODES_SCRIPT.format(address=address)], env=env,
                         capture_output=True, text=True, timeout=120)
    line = next((x for x in out.stdout.splitlines() if x.startswith("NODES ")), None)
    assert line, out.stderr[-3000:]
    return [n for n in json.loads(line[len("NODES "):]) if n["alive"]]


def _wait_nodes(env, address, want, logs, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if len(_nodes(env, address)) >= want:
                return
        except (AssertionError, subprocess.TimeoutExpired):
            pass
        time.sleep(2)
    raise AssertionError("Ray cluster did not start: " + "\n".join(
        p.read_text()[-2000:] for p in sorted(logs.iterdir())))


def test_draft_actor_runs_on_the_node_with_the_resource(cluster, session_tmp, target_dir,
                                                        specbench_chat, plain_greedy):
    draft_nodes = [n["id"] for n in cluster["nodes"] if n["resources"].get("duo_draft")]
    assert len(cluster["nodes"]) == 2 and len(draft_nodes) == 1
    keep = {k: cluster["env"][k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", MARKER)}
    duo = {"ray_address": cluster["address"], "resources": {"duo_draft": 1},
           "draft_cores": [1]}
    # one request at a time, the product's case: ten prompts at once would have the
    # one draft core prefill ~3000 prompt tokens, which can outlast these 64-token
    # answers (tests/test_e2e_vllm.py, the batched combo), and no draft would arrive
    # (one prompt per task: placement is what this test adds to tests/test_e2e_vllm.py)
    pick = range(0, len(specbench_chat), 2)
    out = run_vllm(session_tmp, "cluster", target=target_dir,
                   prompts=[specbench_chat[i] for i in pick], max_tokens=64, sequential=True,
                   speculative_config=speculative_config(4, duo), env={**E2E_ENV, **keep})
    placed = re.findall(r"DuoProposer: draft .* \(Ray node ([0-9a-f]+)\)", out["log"])
    assert placed == draft_nodes, (placed, cluster["nodes"])
    assert out["token_ids"] == [plain_greedy["token_ids"][i] for i in pick]
    assert out["metrics"]["accepted"] > 0


def test_no_node_with_the_resource_is_a_startup_error(cluster, session_tmp, target_dir):
    keep = {k: cluster["env"][k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", MARKER)}
    duo = {"ray_address": cluster["address"], "resources": {"duo_gpu_box": 1},
           "draft_cores": [1]}
    out = run_vllm(session_tmp, "cluster_unplaceable", expect_failure=True, target=target_dir,
                   prompts=["hi"], max_tokens=4, timeout=600,
                   speculative_config=speculative_config(4, duo), env={**E2E_ENV, **keep})
    assert "duo_gpu_box" in out["log"]
