"""Shared fixtures: tiny random-weight models built once per test session; engines without the
connector that tests compare with, run once per session for every test declaring the same
engine (``engine_runs.reference``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_runs import DECLARED, Reference
from warm_start import WarmInterpreter
from xdist_cores import one_core_set_per_worker
from xdist_groups import pytest_collection_modifyitems  # noqa: F401  (--dist loadgroup's groups)

from hybrid_offload.testing import session
from hybrid_offload.testing.models import build_model
from hybrid_offload.testing.services import RedisServer, start_redis_server
from hybrid_offload.testing.session import run_session_subprocess

# the kit's contract suite (hybrid_offload.testing): pytest's detailed assertion messages there too
pytest.register_assert_rewrite("hybrid_offload.testing.backend_contract")

ModelFactory = Callable[..., Path]

one_core_set_per_worker()  # engines of two xdist workers must not share cores; before torch loads
#: processes the tests start skip the last garbage collection at exit (tests/exit_without_gc)
EXIT_WITHOUT_GC = str(Path(__file__).parent / "exit_without_gc")
if EXIT_WITHOUT_GC not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [EXIT_WITHOUT_GC, os.environ.get("PYTHONPATH")]))
session.launch = WarmInterpreter().launch  # engine runs fork from an interpreter with vLLM imported


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


@pytest.fixture(scope="session")
def reference_run(model_dir: ModelFactory) -> Callable[[Reference], dict[str, Any]]:
    """``reference_run(ref)``: the result (as ``run_session_subprocess`` gives it, one pass) of the
    engine without the connector for ``ref``'s prompts. The first call for an engine runs every
    reference declared for that engine (``engine_runs.reference``) in one engine start, once per
    session (per xdist worker); later calls, from any module, read its result."""
    rows: dict[Reference, list[dict[str, Any]]] = {}

    def get(ref: Reference) -> dict[str, Any]:
        if ref not in rows:
            batch = [r for r in DECLARED if r.engine == ref.engine and r not in rows]
            batch += [] if ref in batch else [ref]
            prompts = [list(p) for r in batch for p in r.prompts]
            requests = run_session_subprocess(ref.spec(model_dir(ref.arch), prompts))["passes"][0]["requests"]
            assert len(requests) == len(prompts), "a reference run answered every prompt"
            for r in batch:
                rows[r], requests = requests[: len(r.prompts)], requests[len(r.prompts) :]
        return {"passes": [{"requests": rows[ref]}]}

    return get


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server for the tests of one module."""
    server = start_redis_server(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()
