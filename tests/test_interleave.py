"""benchmarks/interleave.py: per-round ratios, the control pair, merging rounds."""

from __future__ import annotations

import math

import pytest

from benchmarks.interleave import _merge, half_width, markdown, paired, rounds_for


def _method(speeds: dict, latency: float | None = None) -> dict:
    """One method's results: batch 4 greedy at ``speeds[round]`` tok/s (100 tokens a
    round), staggered arrivals with p50 latency ``latency`` times the round's speed."""
    rows = [{"repeat": r, "tokens": 100, "seconds": 100 / v} for r, v in speeds.items()]
    shapes = [{"batch": 4, "temperature": 0.0, "rows": rows}]
    if latency is not None:
        shapes.append({"batch": "staggered", "temperature": 0.0, "rows": [
            {"repeat": r, "tokens": 100, "seconds": 10.0, "latency_s": [latency * v] * 3}
            for r, v in speeds.items()]})
    return {"available": True, "shapes": shapes}


def test_ratios_are_per_round_so_drift_cancels():
    # the machine slows 2x in round 1; the method stays 10% ahead in every round
    results = {"plain-all": _method({0: 10.0, 1: 5.0, 2: 10.0}, latency=1.0),
               "duo-lend": _method({0: 11.0, 1: 5.5, 2: 11.0}, latency=0.5)}
    entry = paired(results, "plain-all")["batch4-t0"]["duo-lend"]
    assert entry["tok_s"]["rounds"] == pytest.approx([1.1, 1.1, 1.1])
    for stat in ("median", "min", "max"):
        assert entry["tok_s"][stat] == pytest.approx(1.1)
    lat = paired(results, "plain-all")["batchstaggered-t0"]["duo-lend"]["p50_s"]
    assert abs(lat["median"] - 0.55) < 1e-9  # 0.5 x 1.1 against 1.0 x 1.0


def test_spread_and_rounds_missing_from_the_baseline():
    results = {"plain-all": _method({0: 10.0, 1: 10.0}),
               "plain-all~2": _method({0: 9.0, 1: 10.5, 2: 7.0})}
    entry = paired(results, "plain-all")["batch4-t0"]["plain-all~2"]["tok_s"]
    assert entry["rounds"] == pytest.approx([0.9, 1.05])  # round 2: no baseline to pair
    assert (entry["min"], entry["max"]) == pytest.approx((0.9, 1.05))
    assert "plain-all~2" in markdown(results, 2)
    assert paired(results, "plain-1core") == {}  # no such engine in the run


def test_the_control_pair_says_how_many_rounds_resolve_two_percent():
    ratios = [0.93, 1.07, 1.0, 0.95, 1.05]  # two engines of one version, round by round
    sd = math.sqrt(sum((math.log(r) - sum(map(math.log, ratios)) / 5) ** 2 for r in ratios) / 4)
    assert half_width(ratios) == pytest.approx(1.96 * 1.2533 * sd / math.sqrt(5))
    assert half_width(ratios * 4) < half_width(ratios) / 1.9  # 4x the rounds: about half
    assert half_width([1.0, 1.0, 1.0]) == 0 and half_width([1.1]) is None
    need = rounds_for(ratios)
    assert half_width(ratios * math.ceil(need / 5)) <= 0.0205
    assert half_width(ratios * (need // 5 // 2)) > 0.02
    results = {"plain-all": _method(dict.fromkeys(range(5), 10.0)),
               "plain-all~2": _method({i: 10.0 * r for i, r in enumerate(ratios)}),
               "duo-lend": _method(dict.fromkeys(range(5), 12.0))}
    text = markdown(results, 5)
    assert f"±2% takes about {need} rounds" in text
    # every method's median comes with its resolution, not the control's alone
    assert f"| 1.000 ±{100 * half_width(ratios):.1f}% (0.930-1.070) | 1.200 ±0.0% " in text
    assert text.count("takes about") == 1  # from the control pair alone


def test_rounds_merge_into_one_shape():
    shapes: list = []
    _merge(shapes, 0, {"rows": [{"repeat": 0}], "spec": {"drafts": 1, "accepted": 2},
                       "duo": {"x": 1}})
    _merge(shapes, 0, {"rows": [{"repeat": 1}], "spec": {"drafts": 3, "accepted": 4},
                       "duo": None})
    assert [r["repeat"] for r in shapes[0]["rows"]] == [0, 1]
    assert shapes[0]["spec"] == {"drafts": 4, "accepted": 6}
    assert shapes[0]["duo"] == {"x": 1}  # the last round that had draft-side counters


def test_a_warm_up_round_runs_first_and_is_not_kept(monkeypatch):
    import types

    from benchmarks import interleave

    calls = []

    class FakeEngine:
        def __init__(self, name, *args):
            self.name = name

        def wait_ready(self):
            return None

        def measure(self, shape, rnd, timeout):
            calls.append((self.name, shape, rnd))
            return {"batch": 4, "temperature": 0.0, "rows": [{"repeat": rnd}],
                    "spec": {"drafts": 0}, "duo": None}

        def close(self):
            pass

    monkeypatch.setattr(interleave, "Engine", FakeEngine)
    monkeypatch.setattr(interleave, "engine_request", lambda name, *a: (None, None, {}, None))
    monkeypatch.setattr(interleave, "shapes_of", lambda args: [{}, {}])
    monkeypatch.setattr(interleave, "SETTLE_S", 0.0)
    args = types.SimpleNamespace(interleave=2, method_timeout=1)
    results = interleave.run_interleaved(["plain-all", "duo-lend"], "t", [], [], args, None,
                                         None, log=lambda *a: None)
    warm = [c for c in calls if c[2] == interleave.WARM_UP]
    assert calls[:len(warm)] == warm  # before any kept round
    assert sorted(warm) == sorted((n, s, interleave.WARM_UP) for n in ("plain-all", "duo-lend")
                                  for s in (0, 1))
    for name in ("plain-all", "duo-lend"):
        kept = [row["repeat"] for shape in results[name]["shapes"] for row in shape["rows"]]
        assert sorted(kept) == [0, 0, 1, 1]  # two shapes, two rounds; no warm-up row
