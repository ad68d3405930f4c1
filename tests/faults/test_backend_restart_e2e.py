"""Fault: the shared tier's server dies mid-run and comes back (empty).

One engine runs the prompts four times against a real Redis server or a real NIXL cache
peer. After pass 0 the server is killed; pass 1 runs with it down; before pass 2 it is
restarted (with no pages); pass 3 must load from it again. Every request of every pass must
produce the greedy tokens of a run without the connector: a cache failure is never a request
failure.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from engine_runs import CHUNK_TOKENS, hit_rate, release_pass, shared_prefix_prompts, tokens, wait_for_pass
from peer_servers import start_peer
from redis_servers import start_redis_server

from hybrid_offload.session import run_session_subprocess

pytestmark = pytest.mark.e2e

BACKOFF = {"retry_after_s": 0.2, "retry_after_max_s": 1.0}


def redis_server(tmp_path: Path) -> tuple[dict[str, Any], Callable[[], None], Callable[[], None]]:
    (tmp_path / "redis").mkdir()
    server = start_redis_server(tmp_path / "redis")
    cfg = {"type": "redis", "name": "redis", "url": server.url, "prefix": uuid.uuid4().hex[:8], **BACKOFF}
    return cfg, server.stop, server.start


def nixl_peer(tmp_path: Path) -> tuple[dict[str, Any], Callable[[], None], Callable[[], None]]:
    peer = start_peer(256 << 20)
    cfg = {"type": "nixl_peer", "name": "nixl_peer", "peers": [peer.address], **BACKOFF}
    return cfg, peer.kill, peer.start


@pytest.mark.parametrize(("arch", "kind"), [("falcon_h1", "redis"), ("qwen3_next", "nixl_peer")])
def test_server_killed_and_restarted_mid_run(arch: str, kind: str, model_dir, tmp_path: Path) -> None:
    model = model_dir(arch)
    prompts = shared_prefix_prompts(CHUNK_TOKENS[arch], seed=2)
    base = {"model": str(model), "prompts": prompts, "max_tokens": 8, "reset_prefix_cache": "request"}
    expected = tokens(run_session_subprocess({**base, "connector": None}), 0)

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
