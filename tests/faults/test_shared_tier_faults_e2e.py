"""Fault matrix, shared-tier cells: a real engine on a real Redis server or NIXL cache peer.

* killed mid-run, restarted (empty): one engine runs the prompts four times; after pass 0 the
  server is killed, pass 1 runs with it down, before pass 2 it is restarted with no pages, and
  pass 3 must load from it again.
* a peer that hangs (SIGSTOP) mid-run: calls time out within ``timeout_s``, the engine never
  stalls beyond that budget, and after SIGCONT the pages stored before the hang load again.

Every request of every pass must produce the greedy tokens of a run without the connector (a
cache failure is never a request failure); the failure shows in the counters and is logged a
few times per outage (each side marks the backend down once), not per page.

Shared engines: the runs without the connector are reference engines of ``engine_runs``
(:data:`BASELINES`): falcon_h1's two prompt sets (seeds 2 and 3, 8 tokens: the redis cell and
the hung peer) run in one engine, with the other modules' references of that engine
(test_bad_config_e2e.py, test_disk_faults_e2e.py); qwen3_next's (the peer cell) in another.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from engine_runs import (
    CHUNK_TOKENS,
    hit_rate,
    reference,
    release_pass,
    shared_prefix_prompts,
    tokens,
    wait_for_pass,
)

from hybrid_offload.testing.services import start_peer, start_redis_server
from hybrid_offload.testing.session import run_session_subprocess

pytestmark = pytest.mark.e2e

BACKOFF = {"retry_after_s": 0.2, "retry_after_max_s": 1.0}
#: the nixl_peer client's own per-peer backoff, as short: by default it doubles to 30 s, so a
#: hang that lasts long (a busy machine) would keep the peer unused for the pass after it
PEER_BACKOFF = {"retry_backoff_s": 0.2, "max_backoff_s": 1.0}
#: (arch, seed) -> the prompts of that seed without the connector
BASELINES = {(arch, seed): reference(arch, shared_prefix_prompts(CHUNK_TOKENS[arch], seed=seed), max_tokens=8)
             for arch, seed in (("falcon_h1", 2), ("qwen3_next", 2), ("falcon_h1", 3))}  # fmt: skip


def redis_server(tmp_path: Path) -> tuple[dict[str, Any], Callable[[], None], Callable[[], None]]:
    (tmp_path / "redis").mkdir()
    server = start_redis_server(tmp_path / "redis")
    cfg = {"type": "redis", "name": "redis", "url": server.url, "prefix": uuid.uuid4().hex[:8], **BACKOFF}
    return cfg, server.stop, server.start


def nixl_peer(tmp_path: Path) -> tuple[dict[str, Any], Callable[[], None], Callable[[], None]]:
    peer = start_peer(256 << 20)
    cfg = {"type": "nixl_peer", "name": "nixl_peer", "peers": [peer.address], "insecure": True, **BACKOFF,
           **PEER_BACKOFF}
    return cfg, peer.kill, peer.start


@pytest.mark.parametrize(("arch", "kind"), [("falcon_h1", "redis"), ("qwen3_next", "nixl_peer")])
def test_server_killed_and_restarted_mid_run(
    arch: str, kind: str, model_dir, reference_run, tmp_path: Path
) -> None:
    model = model_dir(arch)
    prompts = shared_prefix_prompts(CHUNK_TOKENS[arch], seed=2)
    base = {"model": str(model), "prompts": prompts, "max_tokens": 8, "reset_prefix_cache": "request"}
    expected = tokens(reference_run(BASELINES[arch, 2]), 0)

    cfg, kill, start = (redis_server if kind == "redis" else nixl_peer)(tmp_path)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    spec = {**base, "connector": {"backends": [cfg]}, "passes": 4, "pass_barrier": str(barrier)}
    try:
        with ThreadPoolExecutor(1) as pool:
            session = pool.submit(run_session_subprocess, spec)
            wait_for_pass(barrier, 0, session)
            kill()
            release_pass(barrier, 0)
            wait_for_pass(barrier, 1, session)
            start()
            time.sleep(BACKOFF["retry_after_max_s"] + 0.5)  # the next lookup is a probe, not a skip
            release_pass(barrier, 1)
            wait_for_pass(barrier, 2, session)
            release_pass(barrier, 2)
            result = session.result(timeout=600)
    finally:
        kill()

    for index in range(4):
        assert tokens(result, index) == expected, f"pass {index}"
    passes = [p["scheduler"] for p in result["passes"]]
    assert passes[0]["backends"][kind]["loaded_tokens"] > 0  # the 2nd prompt of a document hits
    assert passes[1]["backends"][kind]["unavailable"] >= 1
    assert passes[1]["backends"][kind]["loaded_tokens"] == 0
    assert passes[1]["failed_loads"] == 0
    assert hit_rate(result, 3, kind) >= 0.99  # used again after it returned
    assert_logged_per_outage(result, kind, outages=1)


def assert_logged_per_outage(result: dict[str, Any], name: str, outages: int) -> None:
    """The outage is a warning when each side (scheduler, worker) first sees it, not per page."""
    down = [line for line in result["log"].splitlines() if f"backend {name} unavailable" in line]
    assert 1 <= len(down) <= 2 * outages, down


def test_hung_peer_is_bounded_by_its_timeout_and_used_again_after(
    model_dir, reference_run, tmp_path: Path
) -> None:
    arch = "falcon_h1"
    prompts = shared_prefix_prompts(CHUNK_TOKENS[arch], seed=3)
    base = {
        "model": str(model_dir(arch)), "prompts": prompts, "max_tokens": 8, "reset_prefix_cache": "request"
    }
    expected = tokens(reference_run(BASELINES[arch, 3]), 0)

    peer = start_peer(256 << 20)
    timeout_s = 0.5
    cfg = {"type": "nixl_peer", "name": "peer", "peers": [peer.address], "timeout_s": timeout_s,
           "insecure": True, **BACKOFF, **PEER_BACKOFF}
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    spec = {**base, "connector": {"backends": [cfg]}, "passes": 3, "pass_barrier": str(barrier)}
    try:
        with ThreadPoolExecutor(1) as pool:
            session = pool.submit(run_session_subprocess, spec)
            wait_for_pass(barrier, 0, session)
            peer.pause()
            release_pass(barrier, 0)
            wait_for_pass(barrier, 1, session)
            peer.resume()
            time.sleep(BACKOFF["retry_after_max_s"] + 0.5)  # the next lookup is a probe
            release_pass(barrier, 1)
            result = session.result(timeout=600)
    finally:
        peer.resume()
        peer.kill()

    for index in range(3):
        assert tokens(result, index) == expected, f"pass {index}"
    hung = result["passes"][1]
    # Budget: a request waits at most one lookup timeout, then the peer is skipped (backoff);
    # loads and stores run off the forward path. Normal requests here take well under 1 s.
    slowest = max(r["wall_s"] for r in hung["requests"])
    assert slowest < 4 * timeout_s + 1.0, [r["wall_s"] for r in hung["requests"]]
    assert hung["scheduler"]["backends"]["peer"]["unavailable"] >= 1
    assert hung["scheduler"]["failed_loads"] == 0
    assert hit_rate(result, 0, "peer") > 0  # the 2nd prompt of a document hits
    assert hit_rate(result, 2, "peer") >= 0.99  # pages stored before the hang, still there
    assert_logged_per_outage(result, "peer", outages=1)
