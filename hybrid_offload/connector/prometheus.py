"""hybrid-offload's stats in vLLM's connector stats and Prometheus hooks.

Flow under ``vllm serve``: the worker-role connector (worker process) and the scheduler-role
connector (EngineCore) each return a :class:`HybridOffloadStats` of deltas from
``get_kv_connector_stats``; vLLM aggregates the workers' and the scheduler's (``aggregate``),
sends ``to_dict()`` to the API server in ``SchedulerStats``, and there hands the dict to
:meth:`HybridOffloadPromMetrics.observe` (Prometheus, ``/metrics``) and to
``build_kv_connector_stats`` + ``reduce`` (the periodic log line). The payload's shape and its
tolerance rules are in :func:`hybrid_offload.core.metrics.clean_payload`.

This is the only module of the package that touches prometheus_client or vLLM's metric types.
Exposed names carry the prefix ``hybrid_offload_``; every metric carries vLLM's labels
(``model_name``, ``engine``), per-backend ones also ``backend``.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from hybrid_offload.compat import check_versions, registered_collectors
from hybrid_offload.connector.config import parse_offload_config
from hybrid_offload.core.metrics import (
    ERROR_KINDS,
    LOAD_PHASES,
    LOSS_REASONS,
    clean_payload,
    merge_payloads,
    payload_is_empty,
    summarize,
)

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

PREFIX = "hybrid_offload_"
#: payload counter -> (metric name without prefix and ``_total``, help), label ``backend``
BACKEND_COUNTERS = {
    "lookups": ("lookups", "Lookups (one per request and backend asked)."),
    "hit_tokens": ("hit_tokens", "Prompt tokens a backend could load (loadable prefix per lookup)."),
    "miss_tokens": ("miss_tokens", "Chunk-aligned prompt tokens a backend could not load, per lookup."),
    "loaded_tokens": ("loaded_tokens", "Prompt tokens loaded from a backend."),
    "loaded_bytes": ("loaded_bytes", "Page bytes loaded from a backend."),
    "loaded_pages": ("loaded_pages", "Pages loaded from a backend."),
    "stored_bytes": ("stored_bytes", "Page bytes stored in a backend."),
    "stored_pages": ("stored_pages", "Pages stored in a backend."),
    "evictions": ("evictions", "Pages a backend evicted to make room."),
}
#: connector-wide payload counter -> (metric name, help)
CONNECTOR_COUNTERS = {
    "requests": ("requests", "Requests the connector looked up."),
    "aligned_prompt_tokens": (
        "aligned_prompt_tokens",
        "Chunk-aligned prompt tokens below the prompt length (what a perfect cache could load).",
    ),
    "external_tokens": ("external_tokens", "Prompt tokens scheduled to load from any backend."),
    "failed_loads": ("failed_loads", "Loads that failed (the request was recomputed)."),
    "stores_dropped": ("stores_dropped", "Pages not stored because the store queue was full."),
    "pages_promoted": ("pages_promoted", "Pages a load read from a tier and put into a faster one."),
    "promotions_dropped": (
        "promotions_dropped",
        "Loaded pages not promoted into a faster tier because the store queue was full.",
    ),
    "store_batch_errors": (
        "store_batch_errors",
        "Store batches that failed with an unexpected error, a bug (logged with its traceback).",
    ),
    "lookup_errors": (
        "lookup_errors",
        "Lookups that failed with an unexpected error, a bug (a miss; the first logged with its traceback).",
    ),
    "served_tokens": ("served_tokens", "Tokens loaded for admitted requests (beyond vLLM's own hit)."),
    "loads_written": ("loads_written", "Loads written into vLLM's KV cache (see load_phase_seconds)."),
    "copy_out_seconds": (
        "copy_out_seconds",
        "Seconds the model-runner thread spent copying pages to store out of vLLM's KV cache.",
    ),
    "load_copy_seconds": (
        "load_copy_seconds",
        "GPU loads: device seconds of their copies to the device (part of the write phase).",
    ),
    "reusable_tokens": (
        "reusable_tokens",
        "Tokens of admitted requests that earlier traffic shared, as far as this engine can tell.",
    ),
}
#: connector-wide payload counter -> reason label of hybrid_offload_lost_tokens_total
LOST_COUNTERS = {f"lost_{reason}_tokens": reason for reason in LOSS_REASONS}
#: connector-wide payload counter -> phase label of hybrid_offload_load_phase_seconds_total
PHASE_COUNTERS = {f"load_{phase}_seconds": phase for phase in LOAD_PHASES}
#: payload gauge -> (metric name, help), label ``backend``
GAUGE_METRICS = {
    "available": ("backend_available", "1 while the backend is usable, 0 while it backs off."),
    "used_bytes": ("capacity_used_bytes", "Bytes of page data the backend holds."),
    "state_bytes": (
        "capacity_state_bytes",
        "Of capacity_used_bytes, the bytes of recurrent-state (Mamba/GDN) pages; the rest is attention.",
    ),
    "capacity_bytes": ("capacity_bytes", "Configured capacity of the backend in bytes."),
}
#: payload sample list -> (metric name, help), label ``backend``
HISTOGRAMS = {
    "load_seconds": ("load_seconds", "Seconds per backend read call (one batch of pages)."),
    "store_seconds": ("store_seconds", "Seconds per backend write call (one batch of pages)."),
}
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
_MAX_LABEL = 64


@dataclass
class HybridOffloadStats(KVConnectorStats):
    """vLLM's container for one interval's payload (deltas, samples, gauges).

    The payload is cleaned on construction, so a stats object built from a peer's dict never
    holds values that would break ``aggregate``, ``reduce`` or Prometheus. ``aggregate``
    returns a new object and leaves both inputs unchanged.
    """

    def __post_init__(self) -> None:
        self.data = clean_payload(self.data)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, KVConnectorStats):
            return self
        return HybridOffloadStats(data=merge_payloads(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        return summarize(self.data)

    def is_empty(self) -> bool:
        return payload_is_empty(self.data)


def _unregister_previous() -> None:
    """Drop ``hybrid_offload_*`` collectors an earlier stat logger of this process registered
    (prometheus_client refuses duplicates; vLLM does the same for its ``vllm:*`` metrics)."""
    for collector, names in registered_collectors(REGISTRY).items():
        if any(name.startswith(PREFIX) for name in names):
            with contextlib.suppress(KeyError):
                REGISTRY.unregister(collector)


def _backend_names(vllm_config: VllmConfig) -> list[str]:
    """Backend names of the connector's config ([] if it cannot be read: metrics still work,
    series then appear with their first event)."""
    try:
        assert vllm_config.kv_transfer_config is not None
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        return [_label(b.name) for b in parse_offload_config(extra).backends]
    except Exception as exc:
        logger.debug("hybrid-offload metrics: no backend names from the config (%r)", exc)
        return []


def _label(value: str) -> str:
    return value[:_MAX_LABEL]


class HybridOffloadPromMetrics(KVConnectorPromMetrics):
    """Registers the ``hybrid_offload_*`` metrics and records payloads into them.

    Runs in the API-server process (built by vLLM's PrometheusStatLogger through the
    connector class's ``build_prom_metrics``); ``observe`` is called once per engine step that
    carried stats, from vLLM's output-handling task. Counters only ever increase by the
    payload's deltas; gauges are set to the payload's values; histograms observe each sample.
    ``observe`` never raises.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        check_versions("prometheus_client", what="hybrid-offload metrics")
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_previous()
        names = list(labelnames)
        # vLLM types its three metric classes alike (any of them); they are these (or Ray's)
        counter_cls = cast("type[Counter]", self._counter_cls)
        gauge_cls = cast("type[Gauge]", self._gauge_cls)
        histogram_cls = cast("type[Histogram]", self._histogram_cls)
        self._backend_counters = {
            key: counter_cls(name=PREFIX + metric, documentation=doc, labelnames=[*names, "backend"])
            for key, (metric, doc) in BACKEND_COUNTERS.items()
        }
        self._connector_counters = {
            key: counter_cls(name=PREFIX + metric, documentation=doc, labelnames=names)
            for key, (metric, doc) in CONNECTOR_COUNTERS.items()
        }
        self._errors = counter_cls(
            name=PREFIX + "errors",
            documentation="Backend errors by kind: " + ", ".join(ERROR_KINDS) + ".",
            labelnames=[*names, "backend", "kind"],
        )
        self._lost = counter_cls(
            name=PREFIX + "lost_tokens",
            documentation="Reusable tokens not served, by reason: " + ", ".join(LOSS_REASONS) + ".",
            labelnames=[*names, "reason"],
        )
        self._phases = counter_cls(
            name=PREFIX + "load_phase_seconds",
            documentation="Seconds of written loads by phase: " + ", ".join(LOAD_PHASES)
            + " (total: the load job reaching the worker until written).",
            labelnames=[*names, "phase"],
        )
        self._group_hits = counter_cls(
            name=PREFIX + "group_hit_tokens",
            documentation="Prompt tokens one KV-cache group alone could load, per lookup.",
            labelnames=[*names, "backend", "group"],
        )
        self._gauges = {
            key: gauge_cls(
                name=PREFIX + metric,
                documentation=doc,
                multiprocess_mode="mostrecent",
                labelnames=[*names, "backend"],
            )
            for key, (metric, doc) in GAUGE_METRICS.items()
        }
        self._histograms = {
            key: histogram_cls(
                name=PREFIX + metric,
                documentation=doc,
                buckets=list(LATENCY_BUCKETS),
                labelnames=[*names, "backend"],
            )
            for key, (metric, doc) in HISTOGRAMS.items()
        }
        self._warned = False
        self._start_at_zero(_backend_names(vllm_config))

    def _start_at_zero(self, backends: list[str]) -> None:
        """Create the counter series of every engine and configured backend at 0, so that
        ``/metrics`` lists them (and ``rate()`` works) before the first event."""
        for labels in self.per_engine_labelvalues.values():
            for counter in self._connector_counters.values():
                counter.labels(*labels)
            for reason in LOSS_REASONS:
                self._lost.labels(*labels, reason)
            for phase in LOAD_PHASES:
                self._phases.labels(*labels, phase)
            for backend in backends:
                for counter in self._backend_counters.values():
                    counter.labels(*labels, backend)
                for kind in ERROR_KINDS:
                    self._errors.labels(*labels, backend, kind)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        try:
            labels = self.per_engine_labelvalues.get(engine_idx)
            if labels is None:
                self._warn("no labels for engine %s", engine_idx)
                return
            self._record(clean_payload(transfer_stats_data), list(labels))
        except Exception as exc:  # a metrics glitch must never take the API server down
            self._warn("recording hybrid-offload stats failed: %r", exc)

    def _record(self, data: dict[str, Any], labels: list[object]) -> None:
        for key, value in data.get("counters", {}).items():
            if key in self._connector_counters and value > 0:
                self._connector_counters[key].labels(*labels).inc(value)
            elif key in LOST_COUNTERS and value > 0:
                self._lost.labels(*labels, LOST_COUNTERS[key]).inc(value)
            elif key in PHASE_COUNTERS and value > 0:
                self._phases.labels(*labels, PHASE_COUNTERS[key]).inc(value)
        for name, entry in data.get("backends", {}).items():
            backend = _label(name)
            for key, value in entry.get("counters", {}).items():
                if key in self._backend_counters and value > 0:
                    self._backend_counters[key].labels(*labels, backend).inc(value)
            for kind, value in entry.get("errors", {}).items():
                if value > 0:
                    self._errors.labels(*labels, backend, _label(kind)).inc(value)
            for group, value in entry.get("group_hit_tokens", {}).items():
                if value > 0:
                    self._group_hits.labels(*labels, backend, _label(group)).inc(value)
            for key, value in entry.get("gauges", {}).items():
                if key in self._gauges:
                    self._gauges[key].labels(*labels, backend).set(value)
            for key, samples in entry.get("samples", {}).items():
                if key in self._histograms:
                    child = self._histograms[key].labels(*labels, backend)
                    for seconds in samples:
                        child.observe(seconds)

    def _warn(self, msg: str, *args: object) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("hybrid-offload metrics: " + msg + " (reported once)", *args)
