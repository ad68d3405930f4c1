"""Fault matrix, configuration cell: a real engine (offline vLLM, tiny falcon_h1) starts with
each bad connector config and must stop with one clear error naming the key; a backend that is
unreachable at start-up is a warning, and the engine serves (recomputing) with unchanged output;
a backend that raises a bug in lookups costs hits, never the engine.

Shared engines: the run without the connector that the last two tests compare with
is a reference engine of ``engine_runs`` (:data:`BASELINE`; falcon_h1, 8 tokens), started once
per xdist worker for every module declaring that engine (see there).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_runs import CHUNK_TOKENS, reference, shared_prefix_prompts, tokens

from hybrid_offload.testing.faulty import FAULTY
from hybrid_offload.testing.services import free_port
from hybrid_offload.testing.session import ENGINE_ENV, run_session_subprocess

pytestmark = pytest.mark.e2e

ARCH = "falcon_h1"
ROOT = "kv_connector_extra_config"
PROMPTS = shared_prefix_prompts(CHUNK_TOKENS[ARCH], seed=4)
#: the prompts without the connector
BASELINE = reference(ARCH, PROMPTS, max_tokens=8)

#: Starts one engine per case in a single process (a failed start leaves nothing behind) and
#: prints the error chain of each as JSON.
_STARTER = """
import json, sys
from vllm import LLM
from hybrid_offload.testing.session import kv_transfer_config
model, cases = sys.argv[1], json.loads(sys.argv[2])
errors = {}
for name, extra in cases.items():
    try:
        LLM(model=model, kv_transfer_config=kv_transfer_config(extra), enforce_eager=True, max_model_len=1024)
        errors[name] = None
    except Exception as exc:
        chain, e = [], exc
        while e is not None:
            chain.append(f"{type(e).__name__}: {e}")
            e = e.__cause__ or e.__context__
        errors[name] = chain
print("ERRORS " + json.dumps(errors))
"""


@contextlib.contextmanager
def read_only_directory(path: Path) -> Iterator[Path]:
    """A directory nobody can write to, root included (a read-only tmpfs); a path under
    /proc where mounting is not allowed."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], check=False)
    try:
        yield path if mounted.returncode == 0 else Path("/proc/hybrid-offload-test")
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "-l", str(path)], check=False)


def bad_configs(read_only: Path) -> dict[str, tuple[dict[str, Any], str]]:
    """name -> (kv_connector_extra_config, the key path the error must name)."""
    return {
        "unknown backend type": ({"backends": [{"type": "tape"}]}, f"{ROOT}.backends[0].type"),
        "disk without path": ({"backends": [{"type": "cpu"}, {"type": "disk"}]}, f"{ROOT}.backends[1]"),
        "unwritable directory": (
            {"backends": [{"type": "disk", "path": str(read_only / "cache")}]},
            f"{ROOT}.backends[0]: disk backend 'disk0': option 'path'",
        ),
        "bad redis url": (
            {"backends": [{"type": "redis", "url": "http://127.0.0.1:6379"}]},
            f"{ROOT}.backends[0]",
        ),
        "negative capacity": (
            {"backends": [{"type": "cpu", "capacity_bytes": -1}]},
            f"{ROOT}.backends[0].capacity_bytes",
        ),
        "zero weight": ({"backends": [{"type": "cpu", "load_weight": 0}]}, f"{ROOT}.backends[0].load_weight"),
        "negative weight": (
            {"backends": [{"type": "cpu", "load_weight": -2}]},
            f"{ROOT}.backends[0].load_weight",
        ),
        "chunk size the model cannot use": (
            {"backends": [{"type": "cpu"}], "chunk_tokens": 100},
            f"{ROOT}.chunk_tokens",
        ),
    }


def test_bad_configs_stop_the_engine_naming_the_key(model_dir, tmp_path: Path) -> None:
    with read_only_directory(tmp_path / "ro") as read_only:
        cases = bad_configs(read_only)
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _STARTER,
                str(model_dir(ARCH)),
                json.dumps({k: v[0] for k, v in cases.items()}),
            ],
            env={**os.environ, **ENGINE_ENV},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ERRORS ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = json.loads(line.removeprefix("ERRORS "))
    for name, (_, key) in cases.items():
        chain = errors[name]
        assert chain is not None, f"{name}: the engine started"
        assert chain[0].startswith("ConfigError: ") and key in chain[0], f"{name}: {chain}"


def test_unreachable_backends_at_startup_are_a_warning_not_a_failure(
    model_dir, reference_run, tmp_path: Path
) -> None:
    base = {
        "model": str(model_dir(ARCH)),
        "prompts": PROMPTS,
        "max_tokens": 8,
        "reset_prefix_cache": "request",
    }
    expected = tokens(reference_run(BASELINE), 0)
    closed = free_port()  # nothing listens there
    connector = {
        "backends": [
            {"type": "redis", "name": "redis", "url": f"redis://127.0.0.1:{closed}"},
            {"type": "nixl_peer", "name": "peer", "peers": [f"127.0.0.1:{closed}"], "timeout_s": 0.5,
             "insecure": True},
            {"type": "disk", "name": "disk", "path": str(tmp_path / "disk"), "load_weight": 0.5},
        ]
    }
    result = run_session_subprocess({**base, "connector": connector})
    assert tokens(result, 0) == expected
    warned = [line for line in result["log"].splitlines() if "not reachable at start-up" in line]
    assert {name for name in ("redis", "peer") if any(f"backend {name} " in w for w in warned)} == {
        "redis",
        "peer",
    }
    assert result["passes"][0]["scheduler"]["backends"]["disk"]["loaded_tokens"] > 0  # the rest works


def test_a_backend_raising_what_no_backend_should_in_lookups_costs_hits_not_the_engine(
    model_dir, reference_run, tmp_path: Path
) -> None:
    """vLLM's default engine (EngineCore in its own process): a tier whose every lookup raises a
    bug (``RuntimeError``, not a BackendError). Every request is a miss and completes with the
    tokens of a run without the connector, twice over; the traceback is logged once, not per
    request (before the guard, the first lookup ended EngineCore)."""
    broken = {"type": FAULTY, "name": "broken", "inner": {"type": "disk", "path": str(tmp_path / "disk")},
              "fail": ["contains_batch"], "fail_with": "bug"}  # fmt: skip
    spec = {"model": str(model_dir(ARCH)), "prompts": PROMPTS, "max_tokens": 8, "passes": 2,
            "reset_prefix_cache": "request", "connector": {"backends": [broken]}}  # fmt: skip
    result = run_session_subprocess(spec, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    expected = tokens(reference_run(BASELINE), 0)
    assert tokens(result, 0) == expected and tokens(result, 1) == expected
    failed = [line for line in result["log"].splitlines() if "lookup of" in line and "failed; a miss" in line]
    assert len(failed) == 1 and "RuntimeError: injected bug in contains_batch" in result["log"], failed
