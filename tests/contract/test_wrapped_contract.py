"""Wrapped backends keep the contract: a cpu pool as the connector opens a tier (instruments
over the health gate), and one under the fault-injecting wrapper with no fault injected."""

from __future__ import annotations

from pathlib import Path

from backend_contract import BackendContract

from hybrid_offload.backends import Backend, BackendConfig, create_backend
from hybrid_offload.backends.wrappers import FaultInjectingBackend
from hybrid_offload.connector.config import Tier
from hybrid_offload.connector.tiers import WorkerRecorder, open_tier
from hybrid_offload.core.metrics import Locked, WorkerCounters


def cpu(capacity_bytes: int) -> BackendConfig:
    return BackendConfig(type="cpu", name="cpu-test", capacity_bytes=capacity_bytes)


class TestOpenedTierContract(BackendContract):
    def make_backend(self, tmp_path: Path, capacity_bytes: int) -> Backend:
        return open_tier(Tier(cpu(capacity_bytes)), 0, WorkerRecorder(Locked(WorkerCounters()))).backend


class TestFaultInjectingContract(BackendContract):
    def make_backend(self, tmp_path: Path, capacity_bytes: int) -> Backend:
        return FaultInjectingBackend(create_backend(cpu(capacity_bytes)))
