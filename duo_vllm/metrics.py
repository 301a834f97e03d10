"""DuoProposer's statistics as Prometheus metrics on vLLM's ``/metrics``, from vLLM's
engine-core process through prometheus_client's multiprocess mode (``duo-vllm serve`` sets
``PROMETHEUS_MULTIPROC_DIR``; a bare ``vllm serve`` needs it exported). An ``int`` key is a
counter ``duo:<key>_total`` (a drop counts as a reset), a ``float`` or bool a gauge, a dict
of numbers one metric with a label (``duo:target_step_ms_by_batch{batch="4"}``)."""

from __future__ import annotations

import logging
import math
import re
import threading
import time

PREFIX = "duo:"

# label names of the nested dicts DuoProposer.stats() returns; any other dict gets "key"
LABELS = {
    "branch_hits_by_rank": "rank",
    "predraft_misses": "reason",
    "branch_count_distribution": "branches",
    "chosen_lengths": "length",
    "draft_call_ms_by_width": "width",
    "target_step_ms_by_batch": "batch",
    "lent_step_ms_by_batch": "batch",
    "lent_verify_ms_by_batch": "batch",
    "gate_tokens_per_s": "mode",
}

logger = logging.getLogger(__name__)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))


class MetricsPublisher:
    """Keeps one prometheus_client metric per stats key and feeds it each stats dict."""

    def __init__(self, registry=None):
        from prometheus_client import REGISTRY

        self.registry = REGISTRY if registry is None else registry
        self._metrics: dict[str, tuple] = {}  # key -> (Counter or Gauge, counter?, labelled?)
        self._last: dict[tuple, float] = {}  # (key, label) -> last value seen, for counters
        self._lock = threading.Lock()

    def publish(self, stats: dict) -> None:
        with self._lock:
            for key, value in stats.items():
                if isinstance(value, dict):
                    items = [(str(k), v) for k, v in value.items() if _is_number(v)]
                    counting = all(isinstance(v, int) and not isinstance(v, bool)
                                   for _, v in items)
                    for label, v in items:
                        self._set(key, v, counting, label)
                elif _is_number(value):
                    self._set(key, value, isinstance(value, int) and not isinstance(value, bool))

    def _metric(self, key: str, counting: bool, labelled: bool):
        """(metric, is a counter, has a label) for ``key``; the first value seen decides."""
        entry = self._metrics.get(key)
        if entry is None:
            from prometheus_client import Counter, Gauge

            name = PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", str(key))
            labels = [LABELS.get(key, "key")] if labelled else []
            doc = f"DuoProposer stats()[{key!r}]"
            try:
                if counting:
                    metric = Counter(name, doc, labels, registry=self.registry)
                else:
                    metric = Gauge(name, doc, labels, registry=self.registry,
                                   multiprocess_mode="mostrecent")
            except ValueError:  # the name is taken in this registry: leave the key out
                metric = None
            entry = self._metrics[key] = (metric, counting, labelled)
        return entry

    def _set(self, key: str, value, counting: bool, label: str | None = None) -> None:
        metric, is_counter, labelled = self._metric(key, counting, label is not None)
        if metric is None or labelled != (label is not None):
            return  # a name clash, or a key that changed from number to dict or back
        child = metric.labels(label) if labelled else metric
        if is_counter:
            last = self._last.get((key, label), 0)
            delta = value - last if value >= last else value  # below the last: a reset
            self._last[(key, label)] = value
            if delta > 0:
                child.inc(delta)
        else:
            child.set(float(value))


_default: MetricsPublisher | None = None


def publish(stats: dict) -> None:
    """Export ``stats`` to prometheus_client's default registry; never raises."""
    global _default
    try:
        if _default is None:
            _default = MetricsPublisher()
        _default.publish(stats)
    except Exception as e:  # e.g. prometheus_client missing
        logger.debug("duo_vllm metrics not published: %r", e)


class Reporter:
    """Every ``interval_s``, DuoProposer's statistics published and logged without blocking
    the step: the actor's half is asked for and read on a later step, once it is there."""

    def __init__(self, local, client=None, worker=None, log=logger, interval_s: float = 10.0):
        self.local, self.client, self.worker, self.log = local, client, worker, log
        self.interval_s = interval_s
        self.logged_at, self._ref = time.monotonic(), None

    def maybe_report(self) -> None:
        if time.monotonic() - self.logged_at < self.interval_s:
            return
        if self.client is None:  # the drafter in this process, or none (lookups only)
            s = {**(self.worker.stats() if self.worker is not None else {}), **self.local()}
        elif self._ref is None:
            if self.client.healthy:
                self._ref = self.client.submit("stats")
            return
        elif not self.client.ready(self._ref):
            return
        else:
            ref, self._ref = self._ref, None
            try:
                s = {**self.client.get(ref), **self.local()}
            except Exception:  # the actor restarted meanwhile: the next interval's
                return
        self.logged_at = time.monotonic()
        publish(s)
        self.log.info(summary_line(s))


def summary_line(s: dict) -> str:
    """The periodic log line of DuoProposer's statistics."""
    lookups = (f"lookup tokens accepted {s.get('lookup_tokens_accepted', 0)} of "
               f"{s.get('lookup_tokens_served', 0)} served")
    if "predraft_hit_rate" not in s:  # no draft model (lookups only)
        return (f"DuoProposer (lookups only): {lookups}, steps without lookup drafts "
                f"{s['gate_no_draft_steps']}, propose() "
                f"{1e3 * s['propose_total_s'] / max(1, s['propose_steps']):.1f} ms/step")
    return (f"DuoProposer: pre-draft hit rate {100 * s['predraft_hit_rate']:.1f}%, branch hit "
            f"rate {100 * s['branch_hit_rate']:.1f}%, branches "
            f"{s['branch_count_distribution']}, {s['draft_tokens_per_step']:.2f} draft "
            f"tokens/step, actor busy {100 * s['busy_fraction']:.0f}%, draft "
            f"{s['draft_token_ms']:.1f} ms/token, target step {s['target_step_ms']:.1f} ms, "
            f"wait for drafts {s['propose_wait_ms']:.1f} ms/step, {lookups}")
