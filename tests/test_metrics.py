"""duo_vllm.metrics: DuoProposer's stats dict as duo:* Prometheus metrics."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from duo_vllm.metrics import MetricsPublisher  # noqa: E402

STATS = {
    "steps": 10, "requests": 12, "returned_tokens": 30, "lookup_hits": 3,  # counts
    "busy_fraction": 0.25, "draft_token_ms": 7.5, "target_step_ms": float("nan"),
    "fallback": False, "acceptance_greedy": None, "note": "text",
    "branch_hits_by_rank": {0: 5, 1: 2},  # counts by label
    "target_step_ms_by_batch": {1: 20.0, 4: 31.5},  # gauges by label
    "gate_tokens_per_s": {"1+on": 40.0}, "future_table": {"a": 1},
}


def _value(registry, name, **labels):
    return registry.get_sample_value(name, labels or None)


def test_counts_are_counters_and_rates_gauges():
    reg = prometheus_client.CollectorRegistry()
    MetricsPublisher(reg).publish(STATS)
    assert _value(reg, "duo:steps_total") == 10
    assert _value(reg, "duo:returned_tokens_total") == 30
    assert _value(reg, "duo:lookup_hits_total") == 3  # a key nobody declared
    assert _value(reg, "duo:busy_fraction") == 0.25
    assert _value(reg, "duo:draft_token_ms") == 7.5
    assert _value(reg, "duo:fallback") == 0.0
    assert _value(reg, "duo:branch_hits_by_rank_total", rank="1") == 2
    assert _value(reg, "duo:target_step_ms_by_batch", batch="4") == 31.5
    assert _value(reg, "duo:gate_tokens_per_s", mode="1+on") == 40.0
    assert _value(reg, "duo:future_table_total", key="a") == 1
    # no sample yet (NaN, None) and non-numbers are left out
    names = {m.name for m in reg.collect()}
    assert not {"duo:target_step_ms", "duo:acceptance_greedy", "duo:note"} & names


def test_counters_follow_the_cumulative_counts_and_their_resets():
    reg = prometheus_client.CollectorRegistry()
    pub = MetricsPublisher(reg)
    pub.publish({"steps": 10, "busy_fraction": 0.5})
    pub.publish({"steps": 25, "busy_fraction": 0.4})
    assert _value(reg, "duo:steps_total") == 25
    assert _value(reg, "duo:busy_fraction") == 0.4
    pub.publish({"steps": 4})  # a restarted draft actor counts from zero again
    assert _value(reg, "duo:steps_total") == 29
    pub.publish({"steps": 6})
    assert _value(reg, "duo:steps_total") == 31


def test_a_key_that_changes_shape_or_clashes_is_skipped_not_raised():
    reg = prometheus_client.CollectorRegistry()
    prometheus_client.Gauge("duo:taken", "someone else's", registry=reg)
    pub = MetricsPublisher(reg)
    pub.publish({"taken": 1.0, "shape": 1, "ok": 2})
    pub.publish({"shape": {"x": 1}, "ok": 3})
    assert _value(reg, "duo:shape_total") == 1
    assert _value(reg, "duo:ok_total") == 3


def test_multiprocess_dir_carries_metrics_to_another_process(tmp_path):
    """The /metrics route: a process that publishes with PROMETHEUS_MULTIPROC_DIR
    set (vLLM's engine core) is read back by a MultiProcessCollector, as vLLM's
    API server reads that directory."""
    from prometheus_client import CollectorRegistry, multiprocess

    code = ("import json, sys; from duo_vllm.metrics import publish; "
            "publish(json.loads(sys.argv[1]))")
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code, json.dumps({"steps": 7, "busy_fraction": 0.5})],
                   check=True, env=env, timeout=60, cwd=Path(__file__).resolve().parents[1])
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    assert reg.get_sample_value("duo:steps_total") == 7
    assert reg.get_sample_value("duo:busy_fraction") == 0.5
