"""Backoff of unavailable backends: the state machine, and how the scheduler and worker use it."""

from __future__ import annotations

import pytest

from hybrid_offload.backends.health import BackendHealth


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_failure_backs_off_doubling_up_to_the_maximum() -> None:
    clock = Clock()
    health = BackendHealth("redis", 1.0, 5.0, clock)
    assert health.available() and not health.is_down
    waits = []
    for _ in range(5):
        health.record_failure("get", OSError("down"))
        start = clock.now
        while not health.available():
            clock.now += 0.25
        waits.append(clock.now - start)
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert health.failures == 5 and health.skipped == sum(int(w / 0.25) for w in waits)


def test_success_resets_the_wait_and_counts_a_recovery() -> None:
    clock = Clock()
    health = BackendHealth("peer", 0.5, 30.0, clock)
    health.record_failure("put", OSError("down"))
    health.record_failure("put", OSError("down"))
    assert health.is_down
    clock.now += 10
    assert health.available()  # the probe
    health.record_success()
    assert not health.is_down and health.recoveries == 1
    health.record_success()  # already up: no second recovery
    assert health.recoveries == 1
    health.record_failure("put", OSError("down"))
    clock.now += 0.49
    assert not health.available()
    clock.now += 0.01
    assert health.available()  # back to the initial wait


@pytest.mark.parametrize(("initial", "maximum"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_invalid_waits_are_refused(initial: float, maximum: float) -> None:
    with pytest.raises(ValueError, match="retry_after"):
        BackendHealth("x", initial, maximum)
