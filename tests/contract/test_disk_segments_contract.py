"""The disk backend's segment layout runs the shared backend contract, restarts included."""

from __future__ import annotations

from pathlib import Path

from hybrid_offload.backends import Backend, BackendConfig, create_backend
from hybrid_offload.testing.backend_contract import BackendContract


class TestDiskSegmentsContract(BackendContract):
    def make_backend(self, tmp_path: Path, capacity_bytes: int) -> Backend:
        options = {"path": str(tmp_path / "store"), "layout": "segments"}
        config = BackendConfig("disk", "disk-seg-test", capacity_bytes, options=options)
        return create_backend(config)

    def reopen(self, backend: Backend, tmp_path: Path) -> Backend | None:
        return create_backend(backend.config)
