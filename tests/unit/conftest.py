"""Fixtures shared by the scheduler-side unit tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_connector_scheduler import World, cpu_config

from hybrid_offload.backends.base import BackendConfig
from hybrid_offload.core.spec import ModelSpec


@pytest.fixture
def worlds() -> Iterator[Callable[..., World]]:
    """Factory ``worlds(spec, chunk, backends=(cpu,), policy="weighted") -> World``; closed after."""
    made: list[World] = []

    def make(
        spec: ModelSpec,
        chunk: int,
        backends: tuple[BackendConfig, ...] = (cpu_config(),),
        policy: str = "weighted",
        **scheduler_kw: Any,
    ) -> World:
        made.append(World(spec, chunk, backends, policy, **scheduler_kw))
        return made[-1]

    yield make
    for w in made:
        w.close()
