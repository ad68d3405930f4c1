"""Backends that wrap a backend: the cross-cutting concerns of calling one, each in one place.

The connector never calls a storage backend bare. :func:`hybrid_offload.connector.tiers.open_tier`
composes, when a tier is opened::

    InstrumentedBackend(HealthGatedBackend(<the backend>, health), recorder)

* :class:`HealthGatedBackend` - what happens when a backend fails (Redis times out, the peer is
  gone, the disk errors): the failure marks it down (:class:`~.health.BackendHealth` backs off),
  and while it is down its calls raise :class:`BackendSkippedError` without reaching it.
* :class:`InstrumentedBackend` - timing, success and error counting, usage gauges, reported to
  a :class:`CallRecorder` (the scheduler and the worker count differently).

Fault injection for tests is a wrapper too, outside the product:
:class:`hybrid_offload.testing.faulty.FaultyBackend`.

A wrapper is a :class:`~.base.Backend` (registered as a virtual subclass): same methods, same
contract, same errors; it forwards what it does not handle (``config``, ``stats``, the class
flags, ``take_evicted``, ``scan``, ``close``...) to the backend it wraps. Callers keep catching
:class:`~.base.BackendError`: a skipped call is one (a :class:`~.base.BackendUnavailableError`).

Threading: as thread-safe as the wrapped backend; the wrappers' own state is locked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from .base import (
    Backend,
    BackendClosedError,
    BackendError,
    BackendUnavailableError,
    Buffer,
    InvalidKeyError,
    PageInfo,
    PageLease,
    PageReservation,
)
from .health import BackendHealth
from .retention import Retention

__all__ = [
    "USAGE_SAMPLE_S",
    "BackendSkippedError",
    "BackendWrapper",
    "CallRecorder",
    "HealthGatedBackend",
    "InstrumentedBackend",
    "unwrap",
]

#: the calls that move or probe pages; the health gate and the recorder see these
DATA_CALLS = ("put_batch", "get_batch", "get_into", "lease_batch", "reserve_batch", "contains_batch",
              "delete_batch", "touch_batch")  # fmt: skip
#: a backend's ``used_bytes()`` is read at most this often (after a successful call)
USAGE_SAMPLE_S = 1.0


class BackendSkippedError(BackendUnavailableError):
    """The backend is down and backing off: the call was not made (its pages are misses)."""


class BackendWrapper:
    """Forwards every :class:`~.base.Backend` method to ``inner``; subclasses override what
    they add to. ``inner`` is the wrapped backend (itself possibly a wrapper)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        # the class flags of the backend, read as instance attributes
        self.type_name = inner.type_name
        self.shared_index = inner.shared_index
        self.hit_source = inner.hit_source
        self.touch_refreshes = inner.touch_refreshes
        self.option_defaults = inner.option_defaults
        self.in_place = inner.in_place

    def _call(self, op: str, *args: Any) -> Any:
        """Every data call (:data:`DATA_CALLS`) goes through here: the one place a wrapper
        adds to them."""
        return getattr(self.inner, op)(*args)

    @property
    def config(self) -> Any:
        return self.inner.config

    @property
    def stats(self) -> Any:
        return self.inner.stats

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes

    def put_batch(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        return self._call("put_batch", items)

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._call("get_batch", keys)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        return self._call("get_into", keys, buffers)

    def lease_batch(self, keys: Sequence[str]) -> PageLease:
        return self._call("lease_batch", keys)

    def reserve_batch(self, keys: Sequence[str], sizes: Sequence[int]) -> PageReservation:
        return self._call("reserve_batch", keys, sizes)

    @property
    def arena(self) -> memoryview:
        """The wrapped backend's memory, where it works in place (``in_place``)."""
        return self.inner.arena  # type: ignore[attr-defined]

    def contains_batch(self, keys: Sequence[str]) -> list[bool]:
        return self._call("contains_batch", keys)

    def delete_batch(self, keys: Sequence[str]) -> int:
        return self._call("delete_batch", keys)

    def touch_batch(self, keys: Sequence[str]) -> None:
        self._call("touch_batch", keys)

    def describe_batch(self, hints: Sequence[tuple[str, Retention]]) -> None:
        self.inner.describe_batch(hints)  # a hint, not a data call: never gated or counted

    def get_prefix(self, keys: Sequence[str], nbytes: int, sizes: Sequence[int]) -> list[bytes | None]:
        return self.inner.get_prefix(keys, nbytes, sizes)

    def used_bytes(self) -> int:
        return self.inner.used_bytes()

    def state_bytes(self) -> int | None:
        return self.inner.state_bytes()

    def prepare_data_path(self) -> None:
        self.inner.prepare_data_path()

    def take_evicted(self) -> list[str]:
        return self.inner.take_evicted()

    def scan(self, prefix: str = "") -> Iterator[PageInfo]:
        return self.inner.scan(prefix)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> BackendWrapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


Backend.register(BackendWrapper)


def unwrap(backend: Backend) -> Backend:
    """The storage backend under any wrappers."""
    while isinstance(backend, BackendWrapper):
        backend = backend.inner
    return backend


class HealthGatedBackend(BackendWrapper):
    """Calls a backend only while ``health`` says it is up (or its wait is over: a probe).

    A data call that raises :class:`~.base.BackendError` (other than an invalid key or a
    closed backend: the caller's mistakes) marks the backend down (the error
    propagates); a successful one marks it up. While down, data calls raise
    :class:`BackendSkippedError` at once. ``used_bytes``, ``prepare_data_path``, ``scan`` and
    ``close`` are not gated (a gauge or a maintenance call does not decide the backoff).
    """

    def __init__(self, inner: Backend, health: BackendHealth) -> None:
        super().__init__(inner)
        self.health = health

    def _call(self, op: str, *args: Any) -> Any:
        if not self.health.available():
            raise BackendSkippedError(f"backend {self.name!r} is down (backing off); {op} skipped")
        try:
            result = super()._call(op, *args)
        except (InvalidKeyError, BackendClosedError):
            raise  # the caller's mistake, not the backend's health
        except BackendError as exc:
            self.health.record_failure(op, exc)
            raise
        self.health.record_success()
        return result


class CallRecorder(Protocol):
    """Where :class:`InstrumentedBackend` reports; ``op`` is the method name (:data:`DATA_CALLS`).

    Called on the thread that made the call; implementations take their own locks.
    """

    def called(self, backend: str, op: str, seconds: float) -> None:
        """A call returned after ``seconds``."""

    def failed(self, backend: str, op: str, exc: BackendError) -> None:
        """A call raised ``exc`` (not a skip)."""

    def skipped(self, backend: str, op: str) -> None:
        """A call was not made: the backend is backing off."""

    def usage(
        self, backend: str, used_bytes: int | None, evictions: int, state_bytes: int | None = None
    ) -> None:
        """After a successful call that brings news: the backend's own cumulative evictions
        (reported when they changed), and its ``used_bytes()`` and ``state_bytes()`` when
        sampled (at most every :data:`USAGE_SAMPLE_S`; else None)."""


class InstrumentedBackend(BackendWrapper):
    """Times and counts every data call into ``recorder``; errors propagate unchanged.

    ``used_bytes()`` failing while sampled is logged by nobody and reported as None: a gauge is
    not worth an error (the next data call decides the backend's health).
    """

    def __init__(
        self, inner: Backend, recorder: CallRecorder, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        super().__init__(inner)
        self._recorder = recorder
        self._clock = clock
        self._lock = threading.Lock()
        self._usage_at: float | None = None
        self._name = inner.name  # fixed for the backend's life; read once (per-call cost)
        self._storage = unwrap(inner)
        self._evictions_seen = -1

    def _call(self, op: str, *args: Any) -> Any:
        started = self._clock()
        try:
            result = getattr(self.inner, op)(*args)
        except BackendSkippedError:
            self._recorder.skipped(self._name, op)
            raise
        except BackendError as exc:
            self._recorder.failed(self._name, op, exc)
            raise
        now = self._clock()
        self._recorder.called(self._name, op, now - started)
        if op == "reserve_batch":  # usage changes when the pages are committed
            result.after_commit(lambda: self._report_usage(self._clock()))
        else:
            self._report_usage(now)
        return result

    def _report_usage(self, now: float) -> None:
        (used, state), evictions = self._sample_used(now), self._storage.stats.evictions
        if used is not None or evictions != self._evictions_seen:  # else nothing new to report
            self._evictions_seen = evictions
            self._recorder.usage(self._name, used, evictions, state)

    def _sample_used(self, now: float) -> tuple[int | None, int | None]:
        with self._lock:
            if self._usage_at is not None and now - self._usage_at < USAGE_SAMPLE_S:
                return None, None
            self._usage_at = now
        try:
            return self.inner.used_bytes(), self.inner.state_bytes()
        except BackendError:
            return None, None
