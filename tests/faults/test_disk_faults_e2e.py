"""Fault matrix, disk cells: a real engine (offline vLLM, tiny falcon_h1) on a real disk tier.

Every cell asserts what the matrix promises: every request completes with the greedy tokens of
a run without the connector; what was committed before the fault stays loadable where the
backend survives; the fault shows in the connector's counters and is logged once, not per page.

* corrupted pages (six kinds, one per prompt): detected, never loaded, repaired by the recompute
* disk full (a small tmpfs): stores stop, reads go on, no partial page
* ``kill -9`` of the engine during stores: no partial page visible; a restart rebuilds the index
  and hits
* two engines on one disk directory and one Redis at once: no torn page, each loads the other's

Shared engines: the run without the connector (:func:`expected`) is a reference engine of
``engine_runs`` (:data:`BASELINE`; falcon_h1, 8 tokens), started once per xdist worker for every
module declaring that engine (test_bad_config_e2e.py, test_shared_tier_faults_e2e.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
from disk_faults import (
    ARCH,
    DOCS,
    PAGES_PER_PROMPT,
    SessionProcess,
    disk_backend,
    disk_blobs,
    documents,
    flip_bit,
    foreign_model_page,
    page_files,
    temp_files,
    undecodable,
)
from engine_runs import hit_rate, reference, release_pass, tokens, wait_for_pass

from hybrid_offload.core.model_card import is_card_key
from hybrid_offload.testing.deadlines import wait_until
from hybrid_offload.testing.services import start_redis_server
from hybrid_offload.testing.session import run_session_subprocess

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("disk-faults")]

PROMPTS = documents()
#: the prompts without the connector
BASELINE = reference(ARCH, PROMPTS, max_tokens=8)


@pytest.fixture(scope="module")
def model(model_dir) -> Path:
    return model_dir(ARCH)


@pytest.fixture(scope="module")
def expected(reference_run) -> list[list[int]]:
    """Greedy tokens of every prompt without the connector."""
    return tokens(reference_run(BASELINE), 0)


def spec(model: Path, connector: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "prompts": PROMPTS,
        "max_tokens": 8,
        "reset_prefix_cache": "request",
        "connector": connector,
        **extra,
    }


def backend_counters(result: dict[str, Any], name: str, index: int = -1) -> dict[str, Any]:
    return result["passes"][index]["worker_total"]["backends"][name]


def log_lines(result: dict[str, Any], needle: str) -> list[str]:
    return [line for line in result["log"].splitlines() if needle in line]


# ---- corrupted pages --------------------------------------------------------------------------


def _replace_with(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # "renamed into place"


CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "payload bit flip": lambda p: flip_bit(p, p.stat().st_size - 100),
    "header bit flip": lambda p: flip_bit(p, 40),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "zero length": lambda p: p.write_bytes(b""),
    "other model's page": lambda p: _replace_with(p, foreign_model_page(p.read_bytes())),
    "directory": lambda p: (p.unlink(), p.mkdir()),
}


def test_corrupt_pages_are_detected_never_loaded_and_repaired(
    model: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    root = tmp_path / "disk"
    connector = {"backends": [disk_backend(root)]}
    run_session_subprocess(spec(model, connector))
    pages = page_files(root)
    assert len(pages) == DOCS * PAGES_PER_PROMPT
    damaged = []
    for i, (kind, damage) in enumerate(CORRUPTIONS.items()):
        page = pages[i * PAGES_PER_PROMPT + i % PAGES_PER_PROMPT]  # one page of prompt i
        damage(page)
        damaged.append((kind, page))

    result = run_session_subprocess(spec(model, connector, passes=2))
    assert tokens(result, 0) == expected and tokens(result, 1) == expected
    disk = backend_counters(result, "disk", 0)
    read_corrupt = len(CORRUPTIONS) - 1  # a directory is not a page: a miss at lookup, never read
    assert result["passes"][0]["worker_total"]["bad_pages"] == read_corrupt
    assert disk["errors"].get("bad_page") == read_corrupt
    assert result["passes"][0]["scheduler"]["failed_loads"] == read_corrupt
    assert len(log_lines(result, "bad page")) == 1, "bad pages must be logged once, then counted"
    # the recompute stored every damaged page again: all pages whole, the second pass loads all
    assert all(page.is_file() for _, page in damaged), [k for k, p in damaged if not p.is_file()]
    assert undecodable(disk_blobs(root)) == {}
    assert hit_rate(result, 1, "disk") >= 0.99
    assert result["passes"][1]["scheduler"]["failed_loads"] == 0


# ---- disk full --------------------------------------------------------------------------------


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}): disk-full cell not run")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_disk_full_stops_stores_reads_go_on_no_partial_pages(
    model: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    with small_filesystem(tmp_path / "small", "3m") as root:
        connector = {"backends": [disk_backend(root)]}
        result = run_session_subprocess(spec(model, connector, passes=2))
        assert tokens(result, 0) == expected and tokens(result, 1) == expected
        disk = backend_counters(result, "disk", 0)
        assert disk["store_failures"] > 0, "the filesystem never filled up: make it smaller"
        assert disk["stored_pages"] >= PAGES_PER_PROMPT, "not even one prompt fit: make it larger"
        assert undecodable(disk_blobs(root)) == {} and temp_files(root) == []
        full = log_lines(result, "No space left on device")
        assert len(full) == 1, full  # once, not per page
        # what was stored before the disk filled up is loaded in the next pass
        later = result["passes"][1]
        assert later["scheduler"]["backends"]["disk"]["loaded_tokens"] > 0
        assert later["scheduler"]["failed_loads"] == 0


# ---- kill -9 during stores --------------------------------------------------------------------


def test_engine_killed_during_stores_leaves_no_partial_page_and_restarts_with_hits(
    model: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    root = tmp_path / "disk"
    connector = {"backends": [disk_backend(root, fsync=True)]}
    victim = SessionProcess(spec(model, connector), tmp_path / "victim")
    wait_until(lambda: victim.running("stores") and len(page_files(root)) >= 2 * PAGES_PER_PROMPT, "stores",
               timeout_s=300)
    victim.kill9()
    assert undecodable(disk_blobs(root)) == {}, "a partial page is visible"

    restarted = run_session_subprocess(spec(model, connector))
    assert tokens(restarted, 0) == expected
    assert restarted["passes"][0]["scheduler"]["backends"]["disk"]["loaded_tokens"] > 0
    assert restarted["passes"][0]["worker_total"]["bad_pages"] == 0
    assert temp_files(root) == []  # the dead writer's temp files were removed at start


# ---- two engines, one disk directory and one Redis --------------------------------------------


def test_two_engines_share_disk_and_redis_without_torn_pages(
    model: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    """Engine A runs documents 0-3, B documents 2-5, at the same time (2 and 3 overlap) with
    both tiers; then A runs B's documents 4-5 loading from disk (its heavier tier) and B runs
    A's 0-1 loading from Redis."""
    (tmp_path / "redis").mkdir()
    server = start_redis_server(tmp_path / "redis")
    prefix = uuid.uuid4().hex[:8]
    redis_cfg = {"type": "redis", "name": "redis", "url": server.url, "prefix": prefix}
    root = tmp_path / "disk"
    runs = {
        "a": ([0, 1, 2, 3], [4, 5], {"backends": [disk_backend(root, load_weight=1.0),
                                                 {**redis_cfg, "load_weight": 0.5}]}),
        "b": ([2, 3, 4, 5], [0, 1], {"backends": [{**redis_cfg, "load_weight": 1.0},
                                                 disk_backend(root, load_weight=0.5)]}),
    }  # fmt: skip
    try:
        with ThreadPoolExecutor(2) as pool:
            sessions = {}
            for name, (first, second, connector) in runs.items():
                barrier = tmp_path / f"barrier-{name}"
                barrier.mkdir()
                pass_prompts = [[PROMPTS[i] for i in first], [PROMPTS[i] for i in second]]
                run = spec(model, connector, passes=2, pass_prompts=pass_prompts, pass_barrier=str(barrier))
                sessions[name] = (pool.submit(run_session_subprocess, run), barrier)
            for future, barrier in sessions.values():
                wait_for_pass(barrier, 0, future)
            for _, barrier in sessions.values():
                release_pass(barrier, 0)
            results = {name: future.result(timeout=600) for name, (future, _) in sessions.items()}
        with redis.Redis.from_url(server.url) as client:
            values = {k.decode(): client.get(k) for k in client.scan_iter(f"{prefix}:p:*")
                      if not is_card_key(k.decode().rpartition(":")[2])}  # fmt: skip
    finally:
        server.stop()

    for name, (first, second, _) in runs.items():
        assert tokens(results[name], 0) == [expected[i] for i in first], name
        assert tokens(results[name], 1) == [expected[i] for i in second], name
        assert results[name]["passes"][1]["worker_total"]["bad_pages"] == 0, name
    assert hit_rate(results["a"], 1, "disk") >= 0.99  # B's pages, from the shared directory
    assert hit_rate(results["b"], 1, "redis") >= 0.99  # A's pages, from the shared server
    assert len(values) == DOCS * PAGES_PER_PROMPT
    assert undecodable(values) == {} and undecodable(disk_blobs(root)) == {}
    assert temp_files(root) == []
    shutil.rmtree(root)
