"""Fixtures shared by the scheduler-side and worker-side unit tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from scheduler_world import World, cpu_config
from worker_world import World as WorkerWorld
from worker_world import cpu

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


@pytest.fixture
def world() -> Iterator[Callable[..., WorkerWorld]]:
    """Factory ``world(*backends, **kwargs) -> WorkerWorld`` (one cpu backend if none); shut down after."""
    made: list[WorkerWorld] = []

    def make(*backends: BackendConfig, **kwargs: Any) -> WorkerWorld:
        made.append(WorkerWorld(backends or (cpu(),), **kwargs))
        return made[-1]

    yield make
    for w in made:
        w.worker.shutdown(timeout=10)
