"""The backend wrappers: the health gate, the instruments, and how a tier is opened (what happens
when a backend fails, in one place); failures come from the test kit's ``FaultyBackend``."""

from __future__ import annotations

from typing import Any

import pytest

from hybrid_offload.backends import Backend, BackendConfig, BackendUnavailableError, InvalidKeyError
from hybrid_offload.backends.cpu import CpuBackend
from hybrid_offload.backends.health import BackendHealth
from hybrid_offload.backends.retention import Retention
from hybrid_offload.backends.wrappers import (
    USAGE_SAMPLE_S,
    BackendSkippedError,
    HealthGatedBackend,
    InstrumentedBackend,
    unwrap,
)
from hybrid_offload.connector.config import ROOT, ConfigError, Tier, TierPolicy
from hybrid_offload.connector.tiers import SchedulerRecorder, WorkerRecorder, open_tier
from hybrid_offload.core.metrics import Locked, SchedulerCounters, WorkerCounters
from hybrid_offload.testing.faulty import FaultyBackend

KEY = "0123abcd-" + "0" * 32
OTHER = "0123abcd-" + "1" * 32


class Recorder:
    """Every report, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.state_bytes: list[int | None] = []

    def called(self, backend: str, op: str, seconds: float) -> None:
        self.events.append(("called", op, seconds))

    def failed(self, backend: str, op: str, exc: Exception) -> None:
        self.events.append(("failed", op, type(exc).__name__))

    def skipped(self, backend: str, op: str) -> None:
        self.events.append(("skipped", op))

    def usage(
        self, backend: str, used_bytes: int | None, evictions: int, state_bytes: int | None = None
    ) -> None:
        self.events.append(("usage", used_bytes, evictions))
        self.state_bytes.append(state_bytes)


def cpu(capacity: int = 1 << 20) -> CpuBackend:
    return CpuBackend(BackendConfig("cpu", "pool", capacity))


def test_wrappers_are_backends_and_unwrap() -> None:
    inner = cpu()
    outer = InstrumentedBackend(FaultyBackend(inner), Recorder())
    assert isinstance(outer, Backend) and unwrap(outer) is inner
    assert (outer.name, outer.type_name, outer.shared_index) == ("pool", "cpu", False)
    assert outer.stats is inner.stats
    assert outer.put_batch([(KEY, b"page")]) == [True] and outer.get_batch([KEY]) == [b"page"]


def test_health_gate_backs_off_after_a_failure_then_probes() -> None:
    clock = [0.0]
    faulty = FaultyBackend(cpu())
    gated = HealthGatedBackend(faulty, BackendHealth("pool", 1.0, 8.0, lambda: clock[0]))
    faulty.fail("put_batch")
    with pytest.raises(BackendUnavailableError):
        gated.put_batch([(KEY, b"page")])
    assert gated.health.is_down
    with pytest.raises(BackendSkippedError):  # not called while backing off
        gated.get_batch([KEY])
    assert faulty.calls == {"put_batch": 1}
    clock[0] = 1.0  # the wait is over: the next call is the probe, and it succeeds
    assert gated.put_batch([(KEY, b"page")]) == [True]
    assert not gated.health.is_down and gated.health.recoveries == 1


def test_health_gate_ignores_the_callers_mistakes() -> None:
    gated = HealthGatedBackend(cpu(), BackendHealth("pool", 1.0, 8.0))
    with pytest.raises(InvalidKeyError):
        gated.get_batch(["../etc/passwd"])
    assert not gated.health.is_down
    assert gated.used_bytes() == 0  # not gated: a gauge does not decide the backoff


def test_instruments_time_count_and_sample_usage() -> None:
    ticks = iter([0.0, 0.25, 0.5, 0.5 + USAGE_SAMPLE_S / 2, 10.0, 10.5])
    recorder = Recorder()
    faulty = FaultyBackend(cpu())
    backend = InstrumentedBackend(faulty, recorder, clock=lambda: next(ticks))
    backend.put_batch([(KEY, b"page")])
    backend.contains_batch([KEY])  # within USAGE_SAMPLE_S: used_bytes is not read again
    faulty.fail("get_into")
    with pytest.raises(BackendUnavailableError):
        backend.get_into([KEY], [memoryview(bytearray(8))])
    assert recorder.events == [
        ("called", "put_batch", 0.25),
        ("usage", 4, 0),
        ("called", "contains_batch", USAGE_SAMPLE_S / 2),  # no usage: not sampled, no new evictions
        ("failed", "get_into", "BackendUnavailableError"),
    ]


def test_usage_samples_tell_the_bytes_of_state_pages() -> None:
    """The tier's retention hints say which pages are states: the sampled gauge counts them."""
    recorder, clock = Recorder(), [0.0]
    backend = InstrumentedBackend(cpu(), recorder, clock=lambda: clock[0])
    backend.describe_batch([(KEY, Retention("s-unit", "a-unit", state=True)), (OTHER, Retention("a-unit"))])
    assert backend.put_batch([(KEY, b"state-page"), (OTHER, b"attn")]) == [True, True]
    assert recorder.events[-1] == ("usage", 14, 0) and recorder.state_bytes[-1] == 10
    clock[0] += USAGE_SAMPLE_S
    backend.delete_batch([KEY])
    assert recorder.events[-1] == ("usage", 4, 0) and recorder.state_bytes[-1] == 0


def test_evictions_are_reported_between_usage_samples() -> None:
    recorder = Recorder()
    small = CpuBackend(BackendConfig("cpu", "pool", 4))  # room for one 4-byte page
    backend = InstrumentedBackend(small, recorder, clock=lambda: 0.0)  # one sample, at t=0
    backend.put_batch([(KEY, b"page")])
    backend.put_batch([(OTHER, b"page")])  # evicts KEY: news, although not sampled
    backend.contains_batch([OTHER])  # nothing new: no usage event
    assert [e for e in recorder.events if e[0] == "usage"] == [("usage", 4, 0), ("usage", None, 1)]


def test_a_skipped_call_is_counted_as_skipped_not_timed() -> None:
    recorder = Recorder()
    health = BackendHealth("pool", 1.0, 8.0, lambda: 0.0)
    health.record_failure("put", OSError("down"))
    backend = InstrumentedBackend(HealthGatedBackend(cpu(), health), recorder)
    with pytest.raises(BackendSkippedError):
        backend.contains_batch([KEY])
    assert recorder.events == [("skipped", "contains_batch")]


def test_open_tier_puts_the_instruments_over_the_health_gate() -> None:
    clock = [0.0]
    tier = Tier(BackendConfig("cpu", "pool", 1 << 20), TierPolicy(retry_after_s=2.0, retry_after_max_s=4.0))
    opened = open_tier(tier, 0, Recorder(), lambda: clock[0])
    assert isinstance(opened.backend, InstrumentedBackend)
    gate = opened.backend.inner
    assert isinstance(gate, HealthGatedBackend) and gate.health is opened.health
    assert isinstance(gate.inner, CpuBackend)
    opened.health.record_failure("put", OSError("down"))
    clock[0] = 1.9
    assert not opened.health.available()  # the tier's retry_after_s, on the given clock
    clock[0] = 2.0
    assert opened.health.available()


def test_worker_and_scheduler_count_failures_their_own_way() -> None:
    """The worker counts a skipped call as ``unavailable`` and a failure in ``backend_errors``;
    the scheduler counts a failed lookup as ``unavailable`` (that request missed the tier)."""
    worker_stats, sched_stats = Locked(WorkerCounters()), Locked(SchedulerCounters())
    for recorder in (WorkerRecorder(worker_stats), SchedulerRecorder(sched_stats)):
        faulty = FaultyBackend(cpu())
        health = BackendHealth("pool", 1.0, 8.0, lambda: 0.0)
        backend = InstrumentedBackend(HealthGatedBackend(faulty, health), recorder)
        faulty.fail("contains_batch")
        for _ in range(2):
            with pytest.raises(BackendUnavailableError):
                backend.contains_batch([KEY])
        assert health.is_down and health.skipped == 1
    worker = worker_stats.snapshot()
    assert worker["backend_errors"] == 1
    assert worker["backends"]["pool"]["errors"] == {"lookup": 1, "skipped": 1}
    assert worker["backends"]["pool"]["unavailable"] == 1
    sched = sched_stats.snapshot()["backends"]["pool"]
    assert sched["errors"] == {"lookup": 1, "skipped": 1} and sched["unavailable"] == 1


def test_open_tier_names_the_key_of_a_backend_that_cannot_start(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    tier = Tier(BackendConfig("disk", "disk", 1 << 20, options={"path": str(blocker / "x")}))
    with pytest.raises(ConfigError, match=rf"^{ROOT}\.backends\[3\]"):
        open_tier(tier, 3, Recorder())
