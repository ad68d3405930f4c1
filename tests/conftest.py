"""Shared fixtures: tiny random-weight models built once per test session."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hybrid_offload.testing.models import build_model
from hybrid_offload.testing.services import RedisServer, start_redis_server

# the kit's contract suite (hybrid_offload.testing): pytest's detailed assertion messages there too
pytest.register_assert_rewrite("hybrid_offload.testing.backend_contract")

ModelFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> ModelFactory:
    """Factory `model_dir(arch, *, layers=None, hidden=None, seed=0, **build) -> Path` (``build``:
    more keyword arguments of ``build_model``, e.g. ``init_std``, ``mtp_layers``).

    Builds each distinct model once per session (per xdist worker) and returns its directory.
    Treat the directory as read-only: other tests share it.
    """
    cache: dict[tuple[object, ...], Path] = {}

    def get(
        arch: str, *, layers: int | None = None, hidden: int | None = None, seed: int = 0, **build: object
    ) -> Path:
        key = (arch, layers, hidden, seed, *sorted(build.items()))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"model-{arch}")
            cache[key] = build_model(arch, out, layers=layers, hidden=hidden, seed=seed, **build)  # type: ignore[arg-type]
        return cache[key]

    return get


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server for the tests of one module."""
    server = start_redis_server(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()
