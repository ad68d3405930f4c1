"""The lmcache backend runs the shared backend contract through two of LMCache's connectors:
its Redis connector against a real redis-server, and its file-system connector (``fs://``).

Skipped only when LMCache is not installed (``scripts/install_lmcache.sh`` installs it).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

pytest.importorskip(
    "lmcache", reason="LMCache is not installed: run scripts/install_lmcache.sh (no CUDA deps)"
)
from hybrid_offload.backends import Backend, BackendConfig, create_backend
from hybrid_offload.testing.backend_contract import BackendContract
from hybrid_offload.testing.services import RedisServer

# LMCache's loggers attach opentelemetry's deprecated LoggingHandler: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")
# LMCache's Redis connector close() never returns: every close waits this long (bounded).
CLOSE_TIMEOUT_S = 0.3
_namespaces = itertools.count()


class TestLMCacheRedisContract(BackendContract):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.server = redis_server

    def make_backend(self, tmp_path: Path, capacity_bytes: int) -> Backend:
        options = {
            "remote_url": self.server.url,
            # each instance has its own index: keep instances apart on the shared server
            "namespace": f"contract{next(_namespaces)}",
            "close_timeout_s": CLOSE_TIMEOUT_S,
        }
        return create_backend(BackendConfig("lmcache", "lmcache-redis", capacity_bytes, options=options))


class TestLMCacheFsContract(BackendContract):
    def make_backend(self, tmp_path: Path, capacity_bytes: int) -> Backend:
        options = {"remote_url": f"fs://localhost:0{tmp_path / 'store'}"}
        return create_backend(BackendConfig("lmcache", "lmcache-fs", capacity_bytes, options=options))
