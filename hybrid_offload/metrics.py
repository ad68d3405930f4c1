"""Plain-data counters of the connector. Exporters (Prometheus, logs) read them; nothing here
depends on an exporter."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field


@dataclass
class BackendCounters:
    """What one backend did for this connector (tokens are prompt tokens)."""

    lookups: int = 0
    hit_tokens: int = 0
    loaded_tokens: int = 0
    loaded_pages: int = 0
    loaded_bytes: int = 0
    load_failures: int = 0
    stored_pages: int = 0
    stored_bytes: int = 0
    store_failures: int = 0
    unavailable: int = 0


@dataclass
class SchedulerCounters:
    """Scheduler-side totals; ``aligned_prompt_tokens`` sums, over requests, the tokens of the
    longest chunk-aligned prefix strictly below the prompt length (what a perfect cache could
    load)."""

    requests: int = 0
    aligned_prompt_tokens: int = 0
    external_tokens: int = 0
    group_disagreements: int = 0
    failed_loads: int = 0
    backends: dict[str, BackendCounters] = field(default_factory=dict)

    def backend(self, name: str) -> BackendCounters:
        return self.backends.setdefault(name, BackendCounters())

    def hit_rate(self) -> float:
        return self.external_tokens / self.aligned_prompt_tokens if self.aligned_prompt_tokens else 0.0


@dataclass
class WorkerCounters:
    """Worker-side totals."""

    pages_copied_out: int = 0
    bytes_copied_out: int = 0
    pages_loaded: int = 0
    bytes_loaded: int = 0
    bad_pages: int = 0
    missing_pages: int = 0
    stores_dropped: int = 0
    backend_errors: int = 0
    backends: dict[str, BackendCounters] = field(default_factory=dict)

    def backend(self, name: str) -> BackendCounters:
        return self.backends.setdefault(name, BackendCounters())


class Locked:
    """A counters object plus the lock that guards it; ``snapshot()`` returns a plain dict."""

    def __init__(self, counters: SchedulerCounters | WorkerCounters) -> None:
        self.counters = counters
        self.lock = threading.Lock()

    def snapshot(self) -> dict:
        with self.lock:
            return asdict(self.counters)
