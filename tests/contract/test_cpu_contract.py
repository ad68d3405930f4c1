"""The cpu pool runs the shared backend contract."""

from __future__ import annotations

from pathlib import Path

from hybrid_offload.backends import Backend, BackendConfig, create_backend
from hybrid_offload.testing.backend_contract import BackendContract


class TestCpuContract(BackendContract):
    def make_backend(self, tmp_path: Path, capacity_bytes: int) -> Backend:
        return create_backend(
            BackendConfig(type="cpu", name="cpu-test", capacity_bytes=capacity_bytes)
        )
