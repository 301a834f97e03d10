"""Options under vLLM's Ray executors (issue 14, item 8; issue 64): which route reaches
the workers, checked against the installed vLLM's own functions (no engine, no Ray).

``--distributed-executor-backend ray`` picks RayExecutorV2: in vLLM 0.33 always (0.33
removed the legacy RayDistributedExecutor and ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND``), in
0.32 unless ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``. RayExecutorV2 hands its workers the
driver's whole environment (``vllm/v1/executor/ray_env_utils.get_driver_env_vars``).
Ray data-parallel engine actors (``--data-parallel-backend ray``), and 0.32's legacy
executor, copy only what ``vllm/ray/ray_env.get_env_vars_to_copy`` names: vLLM's
variables, some prefixes, and ``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY``. The speculative config
is part of the ``VllmConfig`` each worker is built from, so it always arrives.
"""

import importlib.util
import inspect
import pickle
from types import SimpleNamespace

import pytest

from duo_vllm.config import ENV_VAR, RAY_EXTRA_ENV, DuoConfig, forward_to_ray_workers

pytest.importorskip("vllm")

OPTIONS = '{"n_ctx": 512, "draft_cores": [3]}'
WORKER_SPECIFIC = {"CUDA_VISIBLE_DEVICES", "LOCAL_RANK"}
LEGACY_SWITCH = "VLLM_USE_RAY_V2_EXECUTOR_BACKEND"  # vLLM 0.32 only


@pytest.fixture
def fresh_envs(monkeypatch):
    """vLLM's env readers without its cache (an engine in this process turns it on)."""
    import vllm.envs as envs

    envs.disable_envs_cache()
    for name in (RAY_EXTRA_ENV, "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", LEGACY_SWITCH):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ENV_VAR, OPTIONS)
    return envs


def ray_executor():
    """The executor class vLLM picks for ``--distributed-executor-backend ray``."""
    from vllm.v1.executor.abstract import Executor

    return Executor.get_class(SimpleNamespace(
        parallel_config=SimpleNamespace(distributed_executor_backend="ray")))


def copied_by_name() -> set[str]:
    """What Ray data-parallel engines (and 0.32's legacy executor) copy to their actors."""
    from vllm.ray.ray_env import get_env_vars_to_copy

    return get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC, destination="workers")


def test_the_ray_executor_forwards_duo_vllm_config(fresh_envs):
    from vllm.v1.executor.ray_env_utils import get_driver_env_vars

    executor = ray_executor()
    assert executor.__name__ == "RayExecutorV2"  # 0.32's default, 0.33's only one
    assert "get_driver_env_vars" in inspect.getsource(executor)  # the driver's environment
    assert get_driver_env_vars(WORKER_SPECIFIC)[ENV_VAR] == OPTIONS


def test_a_legacy_ray_executor_exists_only_where_vllm_has_its_switch(fresh_envs, monkeypatch):
    """0.32: ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0`` picks RayDistributedExecutor, which
    copies only named variables; 0.33: neither the switch nor that executor exists."""
    has_switch = LEGACY_SWITCH in fresh_envs.environment_variables
    legacy = importlib.util.find_spec("vllm.v1.executor.ray_executor") is not None
    assert has_switch == legacy
    monkeypatch.setenv(LEGACY_SWITCH, "0")
    assert ray_executor().__name__ == ("RayDistributedExecutor" if legacy else "RayExecutorV2")


def test_ray_data_parallel_engines_forward_it_only_when_named(fresh_envs, monkeypatch):
    from vllm.ray.ray_env import get_env_vars_to_copy
    from vllm.v1.engine import utils as engine_utils

    assert engine_utils.get_env_vars_to_copy is get_env_vars_to_copy  # the engine actors'
    assert ENV_VAR not in copied_by_name()
    monkeypatch.setenv(RAY_EXTRA_ENV, ENV_VAR)
    assert ENV_VAR in copied_by_name()


def test_duo_vllm_serve_names_it_for_vllm(fresh_envs, monkeypatch):
    """``duo-vllm serve`` adds DUO_VLLM_CONFIG to VLLM_RAY_EXTRA_ENV_VARS_TO_COPY,
    keeping what the user listed; vLLM's function then copies both."""
    from duo_vllm import cli

    _, env, _ = cli.build_serve_command([], environ={ENV_VAR: OPTIONS, RAY_EXTRA_ENV: "FOO"},
                                        default_model=lambda: "/m")
    assert env[RAY_EXTRA_ENV] == f"FOO,{ENV_VAR}"
    monkeypatch.setenv(RAY_EXTRA_ENV, env[RAY_EXTRA_ENV])
    monkeypatch.setenv("FOO", "1")
    assert {ENV_VAR, "FOO"} <= copied_by_name()


def test_forwarding_is_added_once_and_only_when_set():
    assert forward_to_ray_workers({}) == {}
    env = {ENV_VAR: OPTIONS, RAY_EXTRA_ENV: f"{ENV_VAR}, BAR"}
    assert forward_to_ray_workers(env) == env
    assert forward_to_ray_workers({ENV_VAR: OPTIONS})[RAY_EXTRA_ENV] == ENV_VAR


def test_the_speculative_config_travels_with_vllms_config():
    """The worker gets its LoadConfig pickled, as Ray sends the VllmConfig; the
    options are read from it with an empty environment."""
    from vllm.config import LoadConfig

    load = LoadConfig(model_loader_extra_config={"duo": {"n_ctx": 512, "draft_cores": [3]}})
    in_worker = pickle.loads(pickle.dumps(load))
    cfg = DuoConfig.from_sources(in_worker.model_loader_extra_config, environ={})
    assert cfg.n_ctx == 512 and cfg.draft_cores == (3,)
