"""Plain-data counters of the connector, and the plain-data stats payload built from them.

Nothing here depends on an exporter: ``hybrid_offload.connector.prometheus`` adapts the
payload to vLLM's connector stats and Prometheus; session.py, the demo and tests read
:meth:`Locked.snapshot`.

Two layers:

* **Counters** (:class:`SchedulerCounters`, :class:`WorkerCounters`, per backend
  :class:`BackendCounters`) are cumulative for the connector's lifetime and only grow; a few
  gauge fields hold the last value seen. A :class:`Locked` pairs them with the lock that guards
  them, plus bounded lists of latency samples not yet exported.
* **Payloads** (plain dicts, see :func:`clean_payload` for the shape) carry *deltas* since the
  previous :meth:`StatsDelta.take`, the latency samples of that interval and the current
  gauges. They cross processes (msgpack-able: str keys, ints, floats, lists), so every reader
  tolerates missing, unknown, negative or non-numeric fields (older or newer peers).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

#: error kinds per backend: failed lookup/get/put/delete calls, pages that failed verification
#: or were absent at load time, and calls skipped while the backend was backing off
ERROR_KINDS = ("lookup", "get", "put", "delete", "touch", "bad_page", "missing_page", "skipped")
#: gauge fields of :class:`BackendCounters`; how two sources combine (scheduler + worker,
#: several workers): availability is the minimum (down anywhere is down), sizes the maximum
#: (a shared backend reports the same usage from every process: summing would double count)
GAUGES: dict[str, Callable[[float, float], float]] = {
    "available": min,
    "used_bytes": max,
    "state_bytes": max,
    "capacity_bytes": max,
}
#: latency sample lists per backend (seconds per backend call)
SAMPLES = ("load_seconds", "store_seconds")
#: latency samples kept per backend and list between two takes (older ones are dropped)
MAX_SAMPLES = 4096
#: gauges go out when they change, with other data, or at least this often
GAUGE_REFRESH_S = 5.0

_BACKEND_DICTS = ("errors", "group_hit_tokens")


@dataclass
class BackendCounters:
    """What one backend did for this connector (tokens are prompt tokens).

    ``hit_tokens`` / ``miss_tokens``: per lookup, the loadable prefix and the rest of the
    chunk-aligned prompt; ``group_hit_tokens``: per KV-cache group index (a str), the prefix
    that group alone could load. ``load_seconds`` / ``store_seconds`` sum the wall time of
    ``get_into`` / ``put_batch`` calls (``load_calls`` / ``store_calls`` of them).
    ``errors`` counts by kind (:data:`ERROR_KINDS`). Gauges (``available``, ``used_bytes``,
    ``state_bytes``: of it, recurrent-state pages, ``capacity_bytes``) hold the last value
    seen; None where this side cannot know it.
    """

    lookups: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    loaded_tokens: int = 0
    loaded_pages: int = 0
    loaded_bytes: int = 0
    load_failures: int = 0
    stored_pages: int = 0
    stored_bytes: int = 0
    store_failures: int = 0
    unavailable: int = 0
    evictions: int = 0
    load_calls: int = 0
    load_seconds: float = 0.0
    store_calls: int = 0
    store_seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    group_hit_tokens: dict[str, int] = field(default_factory=dict)
    available: int | None = None
    used_bytes: int | None = None
    state_bytes: int | None = None
    capacity_bytes: int | None = None

    def record_lookup(self, hit_tokens: int, aligned_tokens: int, per_group: Mapping[str, int]) -> None:
        self.lookups += 1
        self.hit_tokens += hit_tokens
        self.miss_tokens += max(0, aligned_tokens - hit_tokens)
        for group, tokens in per_group.items():
            self.group_hit_tokens[group] = self.group_hit_tokens.get(group, 0) + tokens


#: why reusable tokens were not served (see ``hybrid_offload.connector.scheduler.coverage``)
LOSS_REASONS = ("no_state", "evicted", "not_stored", "backend_down")


@dataclass
class SchedulerCounters:
    """Scheduler-side totals; ``aligned_prompt_tokens`` sums, over requests, the tokens of the
    longest chunk-aligned prefix strictly below the prompt length (what a perfect cache could
    load). Per admitted request: ``served_tokens`` loaded, ``reusable_tokens`` that earlier
    traffic shared (as far as this engine can tell), and the difference by reason in
    ``lost_<reason>_tokens`` (:data:`LOSS_REASONS`)."""

    requests: int = 0
    aligned_prompt_tokens: int = 0
    external_tokens: int = 0
    group_disagreements: int = 0
    failed_loads: int = 0
    preemptions: int = 0
    served_tokens: int = 0
    reusable_tokens: int = 0
    lost_no_state_tokens: int = 0
    lost_evicted_tokens: int = 0
    lost_not_stored_tokens: int = 0
    lost_backend_down_tokens: int = 0
    #: calls of the lookup (``get_num_new_matched_tokens``) and the seconds they took, keying
    #: new requests included (vLLM may ask about a waiting request more than once)
    lookup_calls: int = 0
    lookup_seconds: float = 0.0
    #: lookups that failed with an unexpected error, a bug (logged; the request recomputes)
    lookup_errors: int = 0
    backends: dict[str, BackendCounters] = field(default_factory=dict)

    def backend(self, name: str) -> BackendCounters:
        return self.backends.setdefault(name, BackendCounters())

    def record_lookup(
        self,
        backend: str,
        hit_tokens: int,
        aligned_tokens: int,
        per_group: Mapping[str, int],
        *,
        disagree: bool,
    ) -> None:
        """One request's lookup in ``backend`` (``disagree``: its groups disagreed on a prefix)."""
        self.backend(backend).record_lookup(hit_tokens, aligned_tokens, per_group)
        self.group_disagreements += int(disagree)

    def record_planned_load(self, hit_tokens: Mapping[str, int], external_tokens: int) -> None:
        """A load planned: tokens per backend, and in all."""
        for name, tokens in hit_tokens.items():
            self.backend(name).loaded_tokens += tokens
        self.external_tokens += external_tokens

    def record_coverage(self, served: int, reusable: int, lost: Mapping[str, int]) -> None:
        self.served_tokens += served
        self.reusable_tokens += reusable
        for reason, tokens in lost.items():
            if reason in LOSS_REASONS:
                name = f"lost_{reason}_tokens"
                setattr(self, name, getattr(self, name) + tokens)

    def hit_rate(self) -> float:
        return self.external_tokens / self.aligned_prompt_tokens if self.aligned_prompt_tokens else 0.0


@dataclass
class WorkerCounters:
    """Worker-side totals."""

    pages_copied_out: int = 0
    bytes_copied_out: int = 0
    #: seconds the model-runner thread spent copying pages out of the KV cache (``save``)
    copy_out_seconds: float = 0.0
    pages_loaded: int = 0
    bytes_loaded: int = 0
    bad_pages: int = 0
    missing_pages: int = 0
    stores_dropped: int = 0
    #: pages a load read from a tier and put into a faster one (promoted), and those dropped
    #: for the pending-bytes budget
    pages_promoted: int = 0
    promotions_dropped: int = 0
    #: store batches that raised an unexpected error (not a BackendError): a bug, logged with
    #: its traceback; the batch's remaining pages were not stored
    store_batch_errors: int = 0
    backend_errors: int = 0
    #: loads written into the KV cache, and where their wall time went (seconds summed over
    #: them, see :data:`LOAD_PHASES`): ``load_total_seconds`` is submitted -> written
    loads_written: int = 0
    load_queued_seconds: float = 0.0
    load_prepare_seconds: float = 0.0
    load_read_seconds: float = 0.0
    load_verify_seconds: float = 0.0
    load_ready_seconds: float = 0.0
    load_write_seconds: float = 0.0
    load_total_seconds: float = 0.0
    #: GPU loads: seconds their copies to the device took (first start to last end, device time;
    #: part of ``load_write_seconds``, where the writes into the KV cache overlap them)
    load_copy_seconds: float = 0.0
    backends: dict[str, BackendCounters] = field(default_factory=dict)

    def backend(self, name: str) -> BackendCounters:
        return self.backends.setdefault(name, BackendCounters())

    def add_loaded(self, backend: str, pages: int, nbytes: int) -> None:
        """Pages read from ``backend`` and written into the KV cache."""
        self.pages_loaded += pages
        self.bytes_loaded += nbytes
        counters = self.backend(backend)
        counters.loaded_pages += pages
        counters.loaded_bytes += nbytes

    def record_load(self, phases: Mapping[str, float]) -> None:
        """One load written into the KV cache; ``phases``: seconds per :data:`LOAD_PHASES` name."""
        self.loads_written += 1
        for phase, seconds in phases.items():
            name = f"load_{phase}_seconds"
            setattr(self, name, getattr(self, name) + seconds)


#: the phases of one load, in order (each a ``load_<phase>_seconds`` worker counter): waiting for
#: the load thread, the load thread's own work (shard keys, read buffers, bookkeeping), backend
#: reads, page verification (checksums, MACs, headers), read and verified until the
#: model-runner thread writes it, the writes into vLLM's KV cache; and the whole (the sum of
#: the others), from the scheduler's load job reaching the worker until written
LOAD_PHASES = ("queued", "prepare", "read", "verify", "ready", "write", "total")


C = TypeVar("C", SchedulerCounters, WorkerCounters)


class Locked(Generic[C]):
    """A counters object plus the lock that guards it; ``snapshot()`` returns a plain dict.

    Threading: every read or write of ``counters`` holds the lock (the scheduler thread, the
    worker's model-runner, store and load threads). Counters change only through the methods
    here (:meth:`add`, :meth:`add_backend`, :meth:`update`, ``record_*``), which take it
    themselves; nothing outside this module takes it.
    """

    def __init__(self, counters: C) -> None:
        self.counters: C = counters
        self.lock = threading.Lock()
        self._samples: dict[str, dict[str, list[float]]] = {}

    def snapshot(self) -> dict:
        with self.lock:
            return _snapshot(self.counters)

    def add(self, **deltas: float) -> None:
        """Add to the connector-wide counters named (e.g. ``add(pages_loaded=3, bytes_loaded=n)``)."""
        with self.lock:
            _add_fields(self.counters, deltas)

    def add_backend(self, backend: str, **deltas: float) -> None:
        """Add to ``backend``'s counters named (fields of :class:`BackendCounters`)."""
        with self.lock:
            _add_fields(self.counters.backend(backend), deltas)

    def update(self, change: Callable[[C], object]) -> None:
        """Run ``change(counters)`` under the lock: for updates of several related fields at once
        (``stats.update(lambda c: c.record_coverage(...))``); it must not block."""
        with self.lock:
            change(self.counters)

    def record_error(self, backend: str, kind: str, n: int = 1) -> None:
        """Count ``n`` errors of ``kind`` (one of :data:`ERROR_KINDS`) for ``backend``."""
        with self.lock:
            errors = self.counters.backend(backend).errors
            errors[kind] = errors.get(kind, 0) + n

    def record_call(self, backend: str, op: str, seconds: float) -> None:
        """One ``get_into`` (op "load") or ``put_batch`` (op "store") call that took ``seconds``."""
        with self.lock:
            counters = self.counters.backend(backend)
            setattr(counters, f"{op}_calls", getattr(counters, f"{op}_calls") + 1)
            setattr(counters, f"{op}_seconds", getattr(counters, f"{op}_seconds") + seconds)
            samples = self._samples.setdefault(backend, {}).setdefault(f"{op}_seconds", [])
            if len(samples) >= MAX_SAMPLES:
                del samples[0]
            samples.append(seconds)

    def update_backend(
        self,
        backend: str,
        *,
        available: int | None = None,
        used_bytes: int | None = None,
        capacity_bytes: int | None = None,
        evictions: int | None = None,
        state_bytes: int | None = None,
    ) -> None:
        """Set gauges to their current values, and ``evictions`` from the backend's own
        cumulative count (never lowered); None leaves a field as it is."""
        with self.lock:
            counters = self.counters.backend(backend)
            if available is not None:
                counters.available = available
            if used_bytes is not None:
                counters.used_bytes = used_bytes
            if state_bytes is not None:
                counters.state_bytes = state_bytes
            if capacity_bytes is not None:
                counters.capacity_bytes = capacity_bytes
            if evictions is not None:
                counters.evictions = max(counters.evictions, evictions)

    def snapshot_and_drain(self) -> tuple[dict, dict[str, dict[str, list[float]]]]:
        """The snapshot and the latency samples recorded since the last call, atomically."""
        with self.lock:
            samples, self._samples = self._samples, {}
            return _snapshot(self.counters), samples


def _add_fields(counters: object, deltas: Mapping[str, float]) -> None:
    for name, delta in deltas.items():
        setattr(counters, name, getattr(counters, name) + delta)  # AttributeError: a wrong name


def _snapshot(counters: SchedulerCounters | WorkerCounters) -> dict[str, Any]:
    """``dataclasses.asdict(counters)``, 20x faster (the fields are known: flat numbers and
    str -> number dicts), since vLLM asks for stats every step."""
    out: dict[str, Any] = dict(vars(counters))
    out["backends"] = {
        name: {**vars(b), "errors": dict(b.errors), "group_hit_tokens": dict(b.group_hit_tokens)}
        for name, b in counters.backends.items()
    }
    return out


def _number(value: Any) -> float | None:
    """``value`` as a finite number >= 0, or None (bools count as numbers: 1/0)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float):
        return value if math.isfinite(value) and value >= 0 else None
    return None


def _numbers(raw: Any) -> dict[str, float]:
    if not isinstance(raw, Mapping):
        return {}
    out = {}
    for key, value in raw.items():
        number = _number(value)
        if isinstance(key, str) and number is not None:
            out[key] = number
    return out


def _samples(raw: Any, limit: int) -> list[float]:
    if not isinstance(raw, list | tuple):
        return []
    values = [v for v in (_number(x) for x in raw) if v is not None]
    return values[-limit:]


def clean_payload(data: Any, max_samples: int = MAX_SAMPLES * 16) -> dict[str, Any]:
    """A clean copy of a stats payload; never raises.

    Shape (every part optional)::

        {"counters": {name: delta},                       # connector-wide
         "backends": {backend: {"counters": {name: delta},
                                "errors": {kind: delta},
                                "group_hit_tokens": {group: delta},
                                "gauges": {name: value},
                                "samples": {"load_seconds": [s, ...], "store_seconds": [...]}}}}

    Values that are not finite numbers >= 0 are dropped, as are unknown sections; unknown
    names inside known sections are kept (a newer peer's counters still aggregate).
    """
    if not isinstance(data, Mapping):
        return {}
    out: dict[str, Any] = {}
    counters = _numbers(data.get("counters"))
    if counters:
        out["counters"] = counters
    backends: dict[str, Any] = {}
    raw_backends = data.get("backends")
    for name, raw in raw_backends.items() if isinstance(raw_backends, Mapping) else ():
        if not isinstance(name, str) or not isinstance(raw, Mapping):
            continue
        entry: dict[str, Any] = {}
        for section in ("counters", "gauges", *_BACKEND_DICTS):
            values = _numbers(raw.get(section))
            if values:
                entry[section] = values
        raw_samples = raw.get("samples")
        if isinstance(raw_samples, Mapping):
            samples = {k: _samples(v, max_samples) for k, v in raw_samples.items() if isinstance(k, str)}
            samples = {k: v for k, v in samples.items() if v}
            if samples:
                entry["samples"] = samples
        if entry:
            backends[name] = entry
    if backends:
        out["backends"] = backends
    return out


def _add(into: dict[str, float], more: Mapping[str, float]) -> None:
    for key, value in more.items():
        into[key] = into.get(key, 0) + value


def merge_payloads(a: Mapping[str, Any], b: Mapping[str, Any], max_samples: int = MAX_SAMPLES * 16) -> dict:
    """Combine two clean payloads (two sources of one step, or two intervals): counters add,
    samples concatenate (the newest ``max_samples`` kept), gauges combine per :data:`GAUGES`
    (max for unknown gauges). Inputs are not modified."""
    out, b = clean_payload(a, max_samples), clean_payload(b, max_samples)
    _add(out.setdefault("counters", {}), b.get("counters", {}))
    backends = out.setdefault("backends", {})
    for name, other in b.get("backends", {}).items():
        entry = backends.setdefault(name, {})
        for section in ("counters", *_BACKEND_DICTS):
            if section in other:
                _add(entry.setdefault(section, {}), other[section])
        gauges = entry.setdefault("gauges", {})
        for key, value in other.get("gauges", {}).items():
            gauges[key] = GAUGES.get(key, max)(gauges[key], value) if key in gauges else value
        samples = entry.setdefault("samples", {})
        for key, values in other.get("samples", {}).items():
            samples[key] = (samples.get(key, []) + list(values))[-max_samples:]
    return clean_payload(out, max_samples)  # drops the empty sections made above


def payload_is_empty(data: Mapping[str, Any]) -> bool:
    """Whether a clean payload carries nothing (no counters, samples nor gauges)."""
    return not data.get("counters") and not data.get("backends")


_NUMBER_TYPES = (int, float)


def _deltas(now: Mapping[str, Any], before: Mapping[str, Any], skip: frozenset[str] = frozenset()) -> dict:
    """Positive differences of the numeric fields not in ``skip`` (a counter never goes
    backwards; if it did, nothing is reported and the new value becomes the baseline)."""
    out = {}
    get = before.get
    for key, value in now.items():
        old = get(key, 0)
        if value != old and type(value) in _NUMBER_TYPES and key not in skip and value > old:
            out[key] = value - old
    return out


def _prune(payload: dict[str, Any]) -> dict[str, Any]:
    """Drop the empty sections of a payload built from our own counters (already clean)."""
    backends = {}
    for name, entry in payload.get("backends", {}).items():
        entry = {k: v for k, v in entry.items() if v}
        if entry:
            backends[name] = entry
    out: dict[str, Any] = {}
    if payload.get("counters"):
        out["counters"] = payload["counters"]
    if backends:
        out["backends"] = backends
    return out


class StatsDelta:
    """Turns one :class:`Locked`'s cumulative counters into payloads of deltas.

    :meth:`take` returns what changed since its previous call (the first call: since start),
    the latency samples recorded meanwhile, and the gauges when they changed, when anything
    else is sent, or every :data:`GAUGE_REFRESH_S` seconds. Thread-safe; the counters keep
    counting (``snapshot()`` users are unaffected). vLLM calls it every engine step, so an
    idle take is one snapshot and one comparison.
    """

    _SKIP = frozenset((*GAUGES, *_BACKEND_DICTS))

    def __init__(self, stats: Locked, clock: Callable[[], float] = time.monotonic) -> None:
        self._stats = stats
        self._clock = clock
        self._lock = threading.Lock()
        self._before: dict[str, Any] = {}
        self._gauges_sent: dict[str, dict[str, float]] = {}
        self._gauges_at: float | None = None

    def take(self) -> dict[str, Any]:
        """The payload since the previous call ({} when there is nothing to send)."""
        with self._lock:
            now, samples = self._stats.snapshot_and_drain()
            t = self._clock()
            refresh = self._gauges_at is None or t - self._gauges_at >= GAUGE_REFRESH_S
            if not samples and not refresh and now == self._before:
                return {}
            out: dict[str, Any] = {"counters": _deltas(now, self._before, frozenset(("backends",)))}
            out["backends"] = backends = {}
            gauges: dict[str, dict[str, float]] = {}
            old_backends = self._before.get("backends", {})
            for name, current in now["backends"].items():
                before = old_backends.get(name, {})
                entry = {"counters": _deltas(current, before, self._SKIP)}
                for section in _BACKEND_DICTS:
                    entry[section] = _deltas(current[section], before.get(section, {}))
                entry["samples"] = samples.get(name, {})
                backends[name] = entry
                gauges[name] = {k: current[k] for k in GAUGES if current[k] is not None}
            self._before = now
            payload = _prune(out)
            if gauges != self._gauges_sent or refresh or payload:
                for name, values in gauges.items():
                    if values:
                        payload.setdefault("backends", {}).setdefault(name, {})["gauges"] = dict(values)
                self._gauges_sent, self._gauges_at = gauges, t
            return payload


def summarize(data: Mapping[str, Any]) -> dict[str, int | float]:
    """A short, flat summary of a clean payload for log lines (connector-wide counters, then
    per backend: ``"<backend> <what>"``)."""
    out: dict[str, int | float] = {}
    for key in (
        "requests",
        "external_tokens",
        "served_tokens",
        "reusable_tokens",
        "failed_loads",
        "stores_dropped",
        "store_batch_errors",
        "lookup_errors",
    ):
        if key in data.get("counters", {}):
            out[key] = data["counters"][key]
    for name, entry in sorted(data.get("backends", {}).items()):
        counters = entry.get("counters", {})
        for key in ("lookups", "hit_tokens", "loaded_tokens"):
            if key in counters:
                out[f"{name} {key}"] = counters[key]
        for key, label in (("loaded_bytes", "loaded MiB"), ("stored_bytes", "stored MiB")):
            if key in counters:
                out[f"{name} {label}"] = round(counters[key] / 2**20, 3)
        for key, label in (("load_seconds", "avg load ms"), ("store_seconds", "avg store ms")):
            samples = entry.get("samples", {}).get(key)
            if samples:
                out[f"{name} {label}"] = round(1e3 * sum(samples) / len(samples), 3)
        errors = sum(entry.get("errors", {}).values())
        if errors:
            out[f"{name} errors"] = errors
        if "available" in entry.get("gauges", {}):
            out[f"{name} available"] = entry["gauges"]["available"]
    return out
