"""README.md's code blocks, run as written: the README's commands must work.

Every fenced block of README.md is one of the kinds below; a block of any other kind
fails here, so the README cannot grow a command that nothing runs.

- the install block (``bash scripts/install.sh`` in a venv): not run here, CI's
  ``.ci/run`` runs exactly that before this suite (checked);
- the test command: not run here (it is this suite), but it must be ``.ci/run``'s;
- ``duo-vllm generate ...``: run in a shell, this environment's ``bin`` first on PATH
  (as after ``. .venv/bin/activate``): a real vLLM engine with DuoProposer (e2e);
- the ``python`` block: written to a file and run with this interpreter (e2e);
- the ``json`` block, the speculative config for vLLM's server: parsed, and its
  DuoProposer options validated as vLLM's start-up would.

Two vLLM engine starts in all (about 1-2 minutes each on 2 cores).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CI = REPO / ".ci" / "run"
TEST_COMMAND = "python -m pytest -q --durations=30 tests"
ENGINE_TIMEOUT = 900  # s; a cold engine start here is 1-2 minutes, the default target's
                      # conversion (first use only) about one more


def readme_blocks() -> list[tuple[str, str]]:
    """(language, text) of every fenced block of README.md, in order."""
    return [(m.group(1), m.group(2)) for m in
            re.finditer(r"^```(\w*)\n(.*?)^```\s*$", README.read_text(), re.M | re.S)]


def kind(lang: str, text: str) -> str:
    if lang == "bash" and "scripts/install.sh" in text:
        return "install"
    if lang == "bash" and "pytest" in text:
        return "tests"
    if lang == "bash" and text.lstrip().startswith("duo-vllm generate"):
        return "generate"
    if lang == "python":
        return "python"
    if lang == "json":
        return "spec-json"
    return "unknown"


BLOCKS = [(i, lang, text, kind(lang, text)) for i, (lang, text) in enumerate(readme_blocks())]
E2E = {"generate", "python"}


def _env() -> dict:
    """The user's shell after ``. .venv/bin/activate``: this interpreter's bin first."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = str(Path(sys.executable).resolve().parents[1])
    return env


def _run(cmd, tmp_path: Path, name: str) -> str:
    log = tmp_path / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), stdout=out,
                              stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT)
    text = log.read_text()
    assert proc.returncode == 0, f"README block {name!r} failed (rc={proc.returncode}):\n" \
                                 f"{text[-6000:]}"
    return text


def test_every_block_is_of_a_kind_this_test_runs():
    assert BLOCKS, "README.md has no code blocks"
    unknown = [(i, lang, text[:80]) for i, lang, text, k in BLOCKS if k == "unknown"]
    assert not unknown, f"README blocks no test runs (add them to tests/test_readme.py): " \
                        f"{unknown}"
    kinds = [k for *_, k in BLOCKS]
    for k in ("install", "tests", "generate", "python"):
        assert kinds.count(k) == 1, f"README should have one {k} block, has {kinds.count(k)}"


def test_the_install_and_test_blocks_are_what_ci_runs():
    """Not run here: .ci/run installs into a fresh venv and then runs this suite."""
    ci = CI.read_text()
    install = next(t for _, _, t, k in BLOCKS if k == "install")
    assert "bash scripts/install.sh" in install and "bash scripts/install.sh" in ci
    assert "venv" in install and "venv" in ci
    tests = next(t for _, _, t, k in BLOCKS if k == "tests")
    assert tests.strip() == TEST_COMMAND
    assert TEST_COMMAND in ci.splitlines()


def test_the_speculative_config_json_is_valid():
    from duo_vllm.cli import speculative_config
    from duo_vllm.config import EXTRA_CONFIG_KEY, DuoConfig

    for _, _, text, k in BLOCKS:
        if k != "spec-json":
            continue
        spec = json.loads(text)
        assert spec["model"] == "duo_vllm.DuoProposer"
        duo = spec["draft_load_config"]["model_loader_extra_config"][EXTRA_CONFIG_KEY]
        DuoConfig.from_dict(duo)  # what DuoProposer's start-up checks
        assert spec == speculative_config(spec["num_speculative_tokens"], duo)


def test_the_options_table_lists_the_user_options():
    from duo_vllm.config import USER_OPTIONS

    text = README.read_text()
    section = text.split("\n## Options", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert listed == list(USER_OPTIONS)
    assert "`tuning`" in section


def _block(k: str) -> str:
    return next(t for _, _, t, kk in BLOCKS if kk == k)


@pytest.mark.e2e
def test_the_generate_command_runs(tmp_path):
    text = _block("generate")
    out = _run(["bash", "-euo", "pipefail", "-c", text], tmp_path, "generate")
    prompts = re.findall(r'--prompt "([^"]+)"', text)
    for p in prompts:
        assert f"### {p}" in out, out[-3000:]
    assert "tokens/s" in out and "--- draft:" in out, out[-3000:]


@pytest.mark.e2e
def test_the_python_block_runs(tmp_path):
    script = tmp_path / "readme_llm.py"
    script.write_text(_block("python"))
    out = _run([sys.executable, str(script)], tmp_path, "python")
    assert "DuoProposer" in out, out[-3000:]  # its start-up log: the proposer was used
    assert "Traceback" not in out, out[-3000:]
