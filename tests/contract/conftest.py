"""Fixtures shared by the backend tests: peer processes, nixl_peer clients and private Redis
servers, always closed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hybrid_offload.backends import BackendConfig, create_backend
from hybrid_offload.backends.nixl_peer.client import NixlPeerBackend
from hybrid_offload.testing.services import (
    PeerFactory,
    PeerProcess,
    RedisServer,
    start_peer,
    start_redis_server,
)

MiB = 1 << 20


@pytest.fixture
def peers() -> Iterator[PeerFactory]:
    """Factory ``peers(capacity_bytes=64 MiB, token=None, **peer_options) -> PeerProcess``."""
    started: list[PeerProcess] = []

    def factory(capacity_bytes: int = 64 * MiB, token: str | None = None, **kw: Any) -> PeerProcess:
        peer = start_peer(capacity_bytes, token, **kw)
        started.append(peer)
        return peer

    yield factory
    for peer in started:
        peer.kill()


@pytest.fixture
def clients() -> Iterator[Callable[..., NixlPeerBackend]]:
    """Factory ``clients(addresses, **options) -> NixlPeerBackend``."""
    opened: list[NixlPeerBackend] = []

    def factory(addresses: list[str], **options: Any) -> NixlPeerBackend:
        tokened = options.get("token_file") is not None or options.get("token_env") is not None
        defaults = {} if tokened else {"insecure": True}  # these peers run --insecure
        config = BackendConfig("nixl_peer", "t", 1 << 30, options={"peers": addresses, **defaults, **options})
        backend = create_backend(config)
        assert isinstance(backend, NixlPeerBackend)
        opened.append(backend)
        return backend

    yield factory
    for backend in opened:
        backend.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis server private to the test (its command counters count this test only)."""
    srv = start_redis_server(tmp_path / "redis")
    try:
        yield srv
    finally:
        srv.stop()
