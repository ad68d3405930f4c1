"""What the worker's load and store pipelines share: the model's geometry, the opened backends,
the device, the counters, and the reports for the scheduler side.

Worker side. :class:`WorkerContext` is made once by :class:`~.offload_worker.OffloadWorker`; ``layouts``
and ``transfers`` are set when vLLM registers its KV cache and read-only after that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from hybrid_offload.backends.base import Backend
from hybrid_offload.connector.metadata import LoadSample
from hybrid_offload.connector.worker.device import DeviceTransfers
from hybrid_offload.connector.worker.page_codec import PageCodec
from hybrid_offload.core.metrics import Locked, WorkerCounters
from hybrid_offload.core.planner import HybridOffloadPlanner
from hybrid_offload.core.spec import ModelSpec
from hybrid_offload.engine.kv_layout import AttentionGroupLayout, MambaGroupLayout


class OutboxReport(NamedTuple):
    """What the outbox held: keys stored per backend, load samples per backend, page sets settled."""

    stored: dict[str, list[str]]
    samples: dict[str, list[LoadSample]]
    settled: list[str]


class Outbox:
    """What the worker reports with the next step's output (thread-safe): keys stored per
    backend, page sets settled (stored, dropped or skipped) and load samples per backend."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stored: dict[str, list[str]] = {}
        self._settled: list[str] = []
        self._samples: dict[str, list[LoadSample]] = {}

    def add_stored(self, backend: str, keys: list[str]) -> None:
        with self._lock:
            self._stored.setdefault(backend, []).extend(keys)

    def settle(self, keys: list[str]) -> None:
        if keys:
            with self._lock:
                self._settled.extend(keys)

    def sample(self, backend: str, nbytes: int, seconds: float, ok: bool) -> None:
        with self._lock:
            self._samples.setdefault(backend, []).append((nbytes, seconds, ok))

    def take(self) -> OutboxReport:
        """What was reported since the last call."""
        with self._lock:
            out = OutboxReport(self._stored, self._samples, self._settled)
            self._stored, self._samples, self._settled = {}, {}, []
        return out


@dataclass
class WorkerContext:
    """The worker's shared state (see the module docstring)."""

    spec: ModelSpec
    planner: HybridOffloadPlanner
    codecs: dict[int, PageCodec]
    #: the opened backends, wrapped (health gate, instruments): pure data movement here
    backends: dict[str, Backend]
    stats: Locked[WorkerCounters]
    #: pages are signed with it and must verify under it (see ``page_format``)
    page_key: bytes | None = None
    #: times the phases of loads
    timer: Callable[[], float] = time.perf_counter
    layouts: dict[int, AttentionGroupLayout | MambaGroupLayout] = field(default_factory=dict)
    transfers: DeviceTransfers = field(default_factory=DeviceTransfers)
    outbox: Outbox = field(default_factory=Outbox)
