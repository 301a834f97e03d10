import json

import pytest

from duo_vllm.config import (
    TUNING_OPTIONS, USER_OPTIONS, DuoConfig, DuoConfigError, nest_tuning,
    parse_cpu_list, resolve_draft_cores, target_cores,
)


def test_defaults_are_valid():
    cfg = DuoConfig()
    assert cfg.use_actor and cfg.draft_cores is None and cfg.n_ctx == 2048


@pytest.mark.parametrize("bad, words", [
    ({"n_ctx": 0}, "n_ctx"),
    ({"tuning": {"max_draft_len": -1}}, "max_draft_len"),
    ({"draft_cores": []}, "draft_cores"),
    ({"draft_cores": "1"}, "draft_cores"),
    ({"draft_cores": [-2]}, "draft_cores"),
    ({"tuning": {"use_actor": "yes"}}, "use_actor"),
    ({"tuning": {"lend_cores": 1}}, "lend_cores"),
    ({"tuning": {"propose_timeout_s": 0}}, "propose_timeout_s"),
    ({"tuning": {"propose_timeout_s": "soon"}}, "propose_timeout_s"),
    ({"tuning": {"max_restarts": -1}}, "max_restarts"),
    ({"resources": {"duo_draft": 0}}, "resources"),
    ({"resources": ["duo_draft"]}, "resources"),
    ({"max_sequences": 1.5}, "max_sequences"),
    ({"draft_quant": "q3_k"}, "draft_quant"),
    ({"draft_window": 8}, "draft_window"),
    ({"draft_window": "all"}, "draft_window"),
    ({"tuning": {"prompt_cache_mb": -1}}, "prompt_cache_mb"),
    ({"tuning": {"prompt_cache_mb": 0.5}}, "prompt_cache_mb"),
    ({"tuning": {"prompt_cache_mb": True}}, "prompt_cache_mb"),
    ({"lookup": "yes"}, "lookup must be true, false or \"only\""),
    ({"max_batch": 0}, "max_batch"),
    ({"max_batch": 2.5}, "max_batch"),
    ({"gate": False}, r"\['gate'\] go under \"tuning\""),
    ({"tuning": {"draft_cores": [1]}}, r"unknown tuning option\(s\) \['draft_cores'\]"),
])
def test_bad_values_name_the_option(bad, words):
    with pytest.raises(DuoConfigError, match=words):
        DuoConfig.from_dict(bad)


def test_placement_and_fault_options():
    cfg = DuoConfig.from_dict({"resources": {"duo_draft": 1},
                               "tuning": {"propose_timeout_s": 0.5, "max_restarts": 0}})
    assert cfg.resources == {"duo_draft": 1} and cfg.propose_timeout_s == 0.5
    assert DuoConfig().propose_timeout_s == "auto" and DuoConfig().max_restarts == 3


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(DuoConfigError, match=r"unknown DuoProposer option\(s\) \['draft_cors'\]"):
        DuoConfig.from_dict({"draft_cors": [1]})


def test_bad_json_in_env_is_reported_with_position():
    with pytest.raises(DuoConfigError, match=r"DUO_VLLM_CONFIG is not valid JSON .*line 1 column"):
        DuoConfig.from_sources(None, environ={"DUO_VLLM_CONFIG": "{draft_cores: [1]"})


def test_env_json_must_be_object():
    with pytest.raises(DuoConfigError, match="must be a JSON object"):
        DuoConfig.from_sources(None, environ={"DUO_VLLM_CONFIG": "[1, 2]"})


def test_env_file_and_speculative_config_merge(tmp_path):
    path = tmp_path / "duo.json"
    path.write_text(json.dumps({"n_ctx": 512, "max_sequences": 3}))
    cfg = DuoConfig.from_sources({"duo": {"n_ctx": 1024}},
                                 environ={"DUO_VLLM_CONFIG": f"@{path}"})
    assert cfg.n_ctx == 1024  # the speculative config wins
    assert cfg.max_sequences == 3


def test_missing_env_file_is_reported():
    with pytest.raises(DuoConfigError, match="cannot read config file"):
        DuoConfig.from_sources(None, environ={"DUO_VLLM_CONFIG": "@/nonexistent/duo.json"})


def test_to_dict_roundtrip():
    for cfg in (DuoConfig(draft_cores=(1,), n_threads=1),
                DuoConfig(lookup_only=True, max_batch=8, gate=False)):
        assert DuoConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_user_options_are_few_and_tuning_is_apart():
    assert len(USER_OPTIONS) <= 12 and not set(USER_OPTIONS) & set(TUNING_OPTIONS)
    cfg = DuoConfig.from_dict({"lookup": "only", "max_batch": 8, "tuning": {"gate": False}})
    assert cfg.lookup and cfg.lookup_only and cfg.max_batch == 8 and not cfg.gate
    assert nest_tuning({"gate": False, "n_ctx": 512, "lookup_only": True}) == {
        "n_ctx": 512, "lookup": "only", "tuning": {"gate": False}}
    with pytest.raises(DuoConfigError, match='lookup "only" needs lookup drafts'):
        DuoConfig(lookup_only=True, lookup=False)


def test_parse_cpu_list():
    assert parse_cpu_list("0,2-4") == [0, 2, 3, 4]
    assert parse_cpu_list("{0,1}") == [0, 1]


def test_target_cores_from_vllm_env():
    assert target_cores({"OMP_PLACES": "{0}"}) == [0]
    assert target_cores({"VLLM_CPU_OMP_THREADS_BIND": "0-2"}) == [0, 1, 2]
    assert target_cores({"VLLM_CPU_OMP_THREADS_BIND": "auto"}) is None
    assert target_cores({}) is None
    # auto binding inside vLLM's worker: libgomp's or Intel OpenMP's list
    assert target_cores({"VLLM_CPU_OMP_THREADS_BIND": "auto", "GOMP_CPU_AFFINITY": "1 0"}) == [0, 1]
    assert target_cores({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,3]"}) == [2, 3]


def test_resolve_rejects_cores_that_do_not_exist():
    with pytest.raises(DuoConfigError, match=r"CPU\(s\) \[7\] that do not exist"):
        resolve_draft_cores(DuoConfig(draft_cores=(1, 7)), available=[0, 1], environ={})


def test_resolve_explicit_cores_reports_sharing():
    cores, shared = resolve_draft_cores(DuoConfig(draft_cores=(0,)), available=[0, 1],
                                        environ={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert cores == [0] and shared
