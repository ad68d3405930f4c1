"""The redis backend runs the shared backend contract against a real redis-server.

One server per test module (per xdist worker); each backend gets a unique ``prefix``, so tests
never see each other's pages or index. ``reopen`` builds a new instance with the same config:
pages survive a client restart.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from hybrid_offload.backends import Backend, BackendConfig, create_backend
from hybrid_offload.testing.backend_contract import BackendContract
from hybrid_offload.testing.services import RedisServer


class TestRedisContract(BackendContract):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.server = redis_server

    def make_backend(self, tmp_path: Path, capacity_bytes: int) -> Backend:
        options = {"url": self.server.url, "prefix": f"t{uuid.uuid4().hex[:12]}"}
        return create_backend(BackendConfig("redis", "redis-test", capacity_bytes, options=options))

    def reopen(self, backend: Backend, tmp_path: Path) -> Backend | None:
        return create_backend(backend.config)
