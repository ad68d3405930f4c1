"""Wrapped backends keep the contract: a cpu pool as the connector opens a tier (instruments
over the health gate), and the test kit's fault-injecting wrapper with no fault injected, around
a backend it was handed and as a configured backend type (around a disk: restarts included)."""

from __future__ import annotations

from pathlib import Path

from hybrid_offload.backends import Backend, BackendConfig, create_backend
from hybrid_offload.connector.config import Tier
from hybrid_offload.connector.tiers import WorkerRecorder, open_tier
from hybrid_offload.core.metrics import Locked, WorkerCounters
from hybrid_offload.testing.backend_contract import BackendContract
from hybrid_offload.testing.faulty import FaultyBackend, faulty_config


def cpu(capacity_bytes: int) -> BackendConfig:
    return BackendConfig(type="cpu", name="cpu-test", capacity_bytes=capacity_bytes)


class TestOpenedTierContract(BackendContract):
    def make_backend(self, tmp_path: Path, capacity_bytes: int) -> Backend:
        return open_tier(Tier(cpu(capacity_bytes)), 0, WorkerRecorder(Locked(WorkerCounters()))).backend


class TestFaultInjectingContract(BackendContract):
    def make_backend(self, tmp_path: Path, capacity_bytes: int) -> Backend:
        return FaultyBackend(create_backend(cpu(capacity_bytes)))


class TestFaultyByConfigContract(BackendContract):
    def make_backend(self, tmp_path: Path, capacity_bytes: int) -> Backend:
        disk = BackendConfig("disk", "disk-test", capacity_bytes, options={"path": str(tmp_path / "store")})
        backend = create_backend(faulty_config(disk))
        assert isinstance(backend, FaultyBackend)
        return backend

    def reopen(self, backend: Backend, tmp_path: Path) -> Backend | None:
        return create_backend(backend.config)
