"""The test kit's ``FaultyBackend`` (hybrid_offload/testing/faulty.py): faults on demand, per
instance, around a backend it is handed or configured as a backend type around any other."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from hybrid_offload.backends import (
    BackendConfig,
    BackendConfigError,
    BackendUnavailableError,
    backend_class,
    create_backend,
)
from hybrid_offload.backends.cpu import CpuBackend
from hybrid_offload.backends.wrappers import InstrumentedBackend
from hybrid_offload.connector.config import ConfigError, Tier, parse_offload_config
from hybrid_offload.connector.scheduler.backend_view import BackendView
from hybrid_offload.connector.tiers import WorkerRecorder, open_tier
from hybrid_offload.core.metrics import Locked, SchedulerCounters, WorkerCounters
from hybrid_offload.testing.faulty import FAULTY, FaultyBackend, faulty_config, faulty_in

KEY = "0123abcd-" + "0" * 32


def cpu(name: str = "pool", capacity: int = 1 << 20) -> BackendConfig:
    return BackendConfig("cpu", name, capacity)


def test_corrupts_reads_holds_calls_and_fails_until_healed() -> None:
    faulty = FaultyBackend(create_backend(cpu()))
    faulty.put_batch([(KEY, b"abcdef")])
    faulty.corrupt_reads(times=1)
    buf = bytearray(6)
    assert faulty.get_into([KEY], [memoryview(buf)]) == [6] and buf != bytearray(b"abcdef")
    assert faulty.get_batch([KEY]) == [b"abcdef"]  # once only

    lent = faulty.lease_batch([KEY])  # not corrupting any more: the page as stored
    assert [bytes(v) for v in lent.views if v is not None] == [b"abcdef"]
    lent.release()
    faulty.corrupt_reads(times=1)  # a lease in place corrupts the page where it is kept
    lent = faulty.lease_batch([KEY])
    assert lent.views[0] is not None and bytes(lent.views[0]) != b"abcdef"
    lent.release()
    assert faulty.get_batch([KEY]) != [b"abcdef"]  # the arena's own byte stays flipped

    held = faulty.hold("contains_batch")
    answers: list[list[bool]] = []
    caller = threading.Thread(target=lambda: answers.append(faulty.contains_batch([KEY])))
    caller.start()
    assert not held.wait(0) and answers == []
    faulty.release("contains_batch")
    caller.join(30)
    assert answers == [[True]]
    faulty.fail("delete_batch", times=None)
    for _ in range(3):
        with pytest.raises(BackendUnavailableError, match="injected delete_batch failure"):
            faulty.delete_batch([KEY])
    faulty.heal()
    assert faulty.delete_batch([KEY]) == 1
    with pytest.raises(ValueError, match="unknown call 'scan'"):
        faulty.fail("scan")


def test_an_empty_page_read_while_corrupting_is_left_alone() -> None:
    faulty = FaultyBackend(create_backend(cpu()))
    faulty.put_batch([(KEY, b"")])
    faulty.corrupt_reads(times=2)
    assert faulty.get_batch([KEY]) == [b""]
    assert faulty.get_into([KEY], [memoryview(bytearray(1))]) == [0]


def test_fail_without_calls_fails_every_data_call_with_the_error_given() -> None:
    faulty = FaultyBackend(create_backend(cpu()))
    faulty.fail(times=None, error=RuntimeError("a bug in a backend"))
    for call in (lambda: faulty.put_batch([(KEY, b"x")]), lambda: faulty.get_batch([KEY]),
                 lambda: faulty.contains_batch([KEY]), lambda: faulty.touch_batch([KEY])):  # fmt: skip
        with pytest.raises(RuntimeError, match="a bug"):
            call()
    assert faulty.calls == {"put_batch": 1, "get_batch": 1, "contains_batch": 1, "touch_batch": 1}
    assert faulty.used_bytes() == 0  # not a data call: never failed
    faulty.heal()
    assert faulty.put_batch([(KEY, b"x")]) == [True]


def test_delays_are_served_by_the_injected_sleep() -> None:
    slept: list[float] = []
    faulty = FaultyBackend(create_backend(cpu()), sleep=slept.append)
    faulty.delay("get_batch", 0.5)
    faulty.put_batch([(KEY, b"x")])
    assert faulty.get_batch([KEY]) == [b"x"] and slept == [0.5]
    faulty.heal()
    faulty.get_batch([KEY])
    assert slept == [0.5]


def test_configured_by_type_around_any_backend(tmp_path: Path) -> None:
    config = faulty_config(cpu("flaky"), fail=["put_batch"], in_place=False)
    assert config.type == FAULTY == "hybrid_offload.testing.faulty:FaultyBackend"
    backend = create_backend(config)
    assert isinstance(backend, FaultyBackend) and isinstance(backend.inner, CpuBackend)
    assert (backend.name, backend.capacity_bytes, backend.in_place, backend.shared_index) == (
        "flaky", 1 << 20, False, False)  # fmt: skip
    assert backend.config.type == FAULTY  # reopening it gives a faulty backend again
    with pytest.raises(BackendUnavailableError):
        backend.put_batch([(KEY, b"x")])
    other = create_backend(config)  # switches are per instance: healing one heals only it
    backend.heal()
    assert backend.put_batch([(KEY, b"x")]) == [True]
    with pytest.raises(BackendUnavailableError):
        other.put_batch([(KEY, b"x")])
    for opened in (backend, other):
        opened.close()

    with create_backend(faulty_config(cpu("broken"), fail=["contains_batch"], fail_with="bug")) as broken:
        with pytest.raises(RuntimeError, match="injected bug in contains_batch"):  # not a BackendError
            broken.contains_batch([KEY])
        assert broken.put_batch([(KEY, b"x")]) == [True]

    disk = faulty_config(BackendConfig("disk", "d", 1 << 20, options={"path": str(tmp_path / "d")}))
    with create_backend(disk) as backend:
        assert backend.put_batch([(KEY, b"page")]) == [True]
        assert (backend.shared_index, backend.hit_source, backend.inner.config.options["path"]) == (
            True, "disk", str(tmp_path / "d"))  # fmt: skip


def test_the_class_serving_a_config_tells_the_inner_types_flags() -> None:
    """The scheduler reads a tier's flags from the class before it opens anything."""
    cls = backend_class(FAULTY)
    served = cls.implementation(faulty_config(cpu()).options)
    assert issubclass(served, FaultyBackend) and served is cls.implementation(faulty_config(cpu()).options)
    assert (served.shared_index, served.hit_source, served.touch_refreshes, served.in_place) == (
        False, "host", True, True)  # fmt: skip
    assert cls.implementation(faulty_config(cpu(), in_place=False).options).in_place is False
    segments = BackendConfig("disk", "d", 1, options={"path": "/nonexistent", "layout": "segments"})
    assert cls.implementation(faulty_config(segments).options).__name__ == "FaultySegmentDiskBackend"

    entry = {"type": FAULTY, "name": "slow", "inner": {"type": "cpu"}, "delay_s": {"get_into": 0.5}}
    tier = parse_offload_config({"backends": [entry]}).backends[0]
    assert tier.backend.options["inner"] == {"type": "cpu"}
    assert tier.backend.options["delay_s"] == {"get_into": 0.5}
    view = BackendView(tier, Locked(SchedulerCounters()))
    assert (view.shared, view.hit_source) == (False, "host")  # answered from the workers' reports


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"inner": {"type": "cpu"}, "retries": 1}, "unknown key"),
        ({}, "'inner' must be a mapping with a 'type'"),
        ({"inner": {"type": "cpu", "colour": "red"}}, "'inner': .*unknown key"),
        ({"inner": {"type": "cpu"}, "fail": ["scan"]}, "fail: unknown call 'scan'"),
        ({"inner": {"type": "cpu"}, "fail": "put_batch"}, "'fail' must be a list"),
        ({"inner": {"type": "cpu"}, "fail_with": "typo"}, "'fail_with' must be one of unavailable, bug"),
        ({"inner": {"type": "cpu"}, "fail_with": ["bug"]}, "'fail_with' must be one of"),
        ({"inner": {"type": "cpu"}, "delay_s": {"get_into": -1}}, "'delay_s' must map"),
        ({"inner": {"type": "cpu"}, "in_place": True}, "'in_place' can only be false"),
    ],
)
def test_bad_options_are_refused_naming_the_key(options: dict, error: str) -> None:
    with pytest.raises(BackendConfigError, match=error):
        create_backend(BackendConfig(FAULTY, "f", 1 << 20, options=options))
    with pytest.raises(ConfigError, match=rf"backends\[0\]: .*{error}"):
        parse_offload_config({"backends": [{"type": FAULTY, **options}]})


def test_faulty_in_finds_it_under_the_connectors_wrappers() -> None:
    opened = open_tier_of(faulty_config(cpu()))
    faulty = faulty_in(opened)
    assert isinstance(faulty, FaultyBackend) and faulty_in(faulty) is faulty
    faulty.fail("contains_batch")
    with pytest.raises(BackendUnavailableError):
        opened.contains_batch([KEY])
    with pytest.raises(LookupError):
        faulty_in(open_tier_of(cpu()))


def open_tier_of(config: BackendConfig) -> InstrumentedBackend:
    """``config``'s backend as the connector opens a tier (instruments over the health gate)."""
    return open_tier(Tier(config), 0, WorkerRecorder(Locked(WorkerCounters()))).backend  # type: ignore[return-value]
