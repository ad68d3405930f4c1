"""The nixl_peer backend runs the shared backend contract against real peer processes.

Each backend gets its own peer process with the capacity the test asks for (startup is about
half a second: Python, NIXL and a UCX agent), so capacity and LRU tests see exactly their own
pool. ``reopen()`` is a new client instance on the same peer: pages survive a client restart,
and a second instance sees the first one's pages (``shared_index = True``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hybrid_offload.backends import Backend, BackendConfig, create_backend
from hybrid_offload.testing.backend_contract import BackendContract
from hybrid_offload.testing.services import PeerProcess, start_peer


class TestNixlPeerContract(BackendContract):
    @pytest.fixture(autouse=True)
    def _peers(self) -> Iterator[None]:
        self._started: list[PeerProcess] = []
        yield
        for peer in self._started:
            peer.kill()

    def make_backend(self, tmp_path: Path, capacity_bytes: int) -> Backend:
        peer = start_peer(capacity_bytes)
        self._started.append(peer)
        options = {"peers": [peer.address], "timeout_s": 5.0, "insecure": True}
        return create_backend(BackendConfig("nixl_peer", "nixl-peer-test", capacity_bytes, options=options))

    def reopen(self, backend: Backend, tmp_path: Path) -> Backend | None:
        return create_backend(backend.config)
