"""vLLM engines for the end-to-end tests, each in a subprocess of its own
(``python -m tests.support.vllm_runner``): its process and signal handling stay
out of pytest's, and all of an engine's memory and Ray processes go when it
exits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNNER = "tests.support.vllm_runner"
E2E_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def runner_env() -> dict:
    """The runner's environment: the repository on its path (and its engine's
    processes'), so a custom proposer class under tests/ loads by its dotted path,
    e.g. ``tests.support.lossy_proposer.LossyDuoProposer``."""
    path = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def run_vllm(tmp_path: Path, name: str, timeout: int = 900, expect_failure: bool = False,
             **request) -> dict:
    """Run tests/support/vllm_runner.py in a subprocess; return its JSON result.

    With ``expect_failure`` the run must fail; its log is returned as ``{"log": ...}``.
    """
    request.setdefault("env", dict(E2E_ENV))
    # eager engines (no torch.compile): the same tokens (greedy output is compared
    # engine against engine, both eager), about a minute less start-up per engine;
    # the `vllm serve` tests (tests/test_serve.py) run compiled, as users do
    request.setdefault("eager", True)
    req_path, out_path = tmp_path / f"{name}.req.json", tmp_path / f"{name}.out.json"
    req_path.write_text(json.dumps(request))
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "w") as log:
        # a module, not a script: a script's own folder would come first on the path of
        # the engine and of the Ray actor, where a support module could shadow a package
        proc = subprocess.run([sys.executable, "-m", RUNNER, str(req_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO,
                              env=runner_env())
    if expect_failure:
        assert proc.returncode != 0, f"vLLM run {name!r} was expected to fail but succeeded"
        return {"log": log_path.read_text()}
    if proc.returncode != 0:
        tail = log_path.read_text()[-6000:]
        raise AssertionError(f"vLLM run {name!r} failed (rc={proc.returncode}):\n{tail}")
    result = json.loads(out_path.read_text())
    result["log"] = log_path.read_text()
    return result
