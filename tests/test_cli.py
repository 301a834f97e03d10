"""``duo-vllm serve``: the server command and environment it builds (nothing is started)."""

import json

import pytest

from duo_vllm import cli


def _spec(cmd):
    return json.loads(cmd[cmd.index("--speculative-config") + 1])


def _build(argv, environ=None, on_cpu=True):
    return cli.build_serve_command(argv, environ={} if environ is None else environ,
                                   default_model=lambda: "/cache/target",
                                   on_cpu=lambda: on_cpu)


def test_default_model_core_split_and_speculative_config(monkeypatch):
    monkeypatch.setattr("duo_vllm.config.allowed_cpus", lambda: [0, 1, 2, 3])
    cmd, env, _ = _build([])
    assert cmd[1] == "-m" and cmd[2].startswith("vllm.entrypoints.")
    assert cmd[3:7] == ["--model", "/cache/target", "--dtype", "float32"]
    # lookups may fill 8 tokens a step, the draft model drafts at most 4 of them
    assert _spec(cmd) == {
        "model": "duo_vllm.DuoProposer", "num_speculative_tokens": 8,
        "draft_load_config": {"model_loader_extra_config": {"duo": {
            "tuning": {"max_draft_len": 4}}}}}
    cmd, _, _ = _build(["--duo", '{"lookup": false}'])  # no lookups: the model's 4 only
    assert _spec(cmd)["num_speculative_tokens"] == 4
    assert _spec(cmd)["draft_load_config"]["model_loader_extra_config"]["duo"] == {
        "lookup": False}
    # the target binds every CPU and lends the last, which the draft shares, back to it
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2,3"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_default_core_split_follows_the_lending_and_draft_core_options(monkeypatch):
    monkeypatch.setattr("duo_vllm.config.allowed_cpus", lambda: [0, 1, 2, 3])

    def bind(argv, environ=None):
        return _build(argv, environ)[1]["VLLM_CPU_OMP_THREADS_BIND"]

    # the draft keeps CPU 3
    assert bind(["--duo", '{"tuning": {"lend_cores": false}}']) == "0,1,2"
    assert bind([], {"DUO_VLLM_CONFIG": '{"tuning": {"lend_cores": false}}'}) == "0,1,2"
    assert bind(["--duo", '{"tuning": {"lend_cores": true}}'],
                {"DUO_VLLM_CONFIG": '{"tuning": {"lend_cores": false}}'}) \
        == "0,1,2,3"  # --duo wins over the environment, as in DuoProposer
    assert bind(["--duo", '{"draft_cores": [1]}']) == "0,2,3"
    # lookups only: no draft, so no core is kept from the target
    assert bind(["--duo", '{"lookup": "only", "tuning": {"lend_cores": false}, '
                          '"draft_cores": [1]}']) \
        == "0,1,2,3"
    with pytest.raises(SystemExit):  # a bad $DUO_VLLM_CONFIG fails before vLLM starts
        bind([], {"DUO_VLLM_CONFIG": '{"tuning": {"lend_cores": "maybe"}}'})


def test_gpu_vllm_gets_no_cpu_binding(monkeypatch):
    """GPU vLLM ignores the binding, but DuoProposer would read it as the target's cores."""
    monkeypatch.setattr("duo_vllm.config.allowed_cpus", lambda: [0, 1, 2, 3])
    _, env, _ = _build([], on_cpu=False)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "VLLM_CPU_KVCACHE_SPACE" not in env
    _, env, _ = _build(["--target-cores", "0-1"], on_cpu=False)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"  # asked for: passed on


def test_model_options_and_unknown_flags_pass_through():
    argv = ["/models/x", "--port", "8123", "-k", "3", "--max-model-len=4096",
            "--duo", '{"tuning": {"gate": false}, "n_ctx": 512}', "--host", "127.0.0.1"]
    cmd, _, _ = _build(argv)
    assert cmd[3:5] == ["--model", "/models/x"]
    assert "--dtype" not in cmd  # only the default target gets float32
    assert cmd[5:-2] == ["--port", "8123", "--max-model-len=4096", "--host", "127.0.0.1"]
    assert _spec(cmd) == {
        "model": "duo_vllm.DuoProposer", "num_speculative_tokens": 3,
        "draft_load_config": {"model_loader_extra_config": {"duo": {
            "tuning": {"gate": False}, "n_ctx": 512}}}}


def test_model_flag_and_user_environment_win():
    cmd, env, _ = _build(["--model", "/m", "--dtype", "bfloat16"],
                         environ={"VLLM_CPU_OMP_THREADS_BIND": "0-6"})
    assert cmd.count("--model") == 1 and "/cache/target" not in cmd
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-6"
    _, env, _ = _build(["--target-cores", "0-1"], environ={"VLLM_CPU_OMP_THREADS_BIND": "0-6"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"  # the flag wins over the variable


@pytest.mark.parametrize("argv", [["--duo", '{"no_such_option": 1}'], ["--duo", "{"],
                                  ["--speculative-config", "{}"], ["-k", "0"]])
def test_bad_options_fail_before_vllm_starts(argv, capsys):
    with pytest.raises(SystemExit):
        _build(argv)
    assert "duo-vllm serve: error" in capsys.readouterr().err


def test_dry_run_prints_the_command(capsys, monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert cli.main(["serve", "/m", "--port", "9", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--speculative-config" in out and "--port 9" in out
    assert "PROMETHEUS_MULTIPROC_DIR" in out


def test_help_lists_our_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--num-speculative-tokens", "--duo", "--target-cores", "--dry-run"):
        assert flag in out
