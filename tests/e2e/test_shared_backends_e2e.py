"""End to end through shared tiers: a prefill engine stores, new decode engines load.

Engine A (the prefill side of disaggregated serving, expressed as offload) runs every prompt
with ``max_tokens=1`` and stores attention KV and Mamba/GDN state to a real Redis server and a
real NIXL cache peer. Engine B, a new process whose only tier is Redis, and engine C, whose only
tier is the peer, then decode the same prompts: each must load >= 99 % of the chunk-aligned
prefix from its tier and produce the greedy tokens of a run without the connector.

The float32 Mamba2 archs go the same ways elsewhere: separate engines through the peer and disk
at every PP x TP layout (test_pp_pages_e2e.py), loads from Redis with a run's tokens
(tests/faults/test_shared_tier_faults_e2e.py).

Shared engines: the run without the connector is a reference engine of ``engine_runs``
(:data:`BASELINE`; qwen3_next, 12 tokens), the same engine as test_connector_e2e.py's qwen3_next
baseline: one start per xdist worker serves both.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from engine_runs import CHUNK_TOKENS, hit_rate, reference, shared_prefix_prompts, tokens

from hybrid_offload.testing.services import start_peer, start_redis_server
from hybrid_offload.testing.session import run_session_subprocess

pytestmark = pytest.mark.e2e

ARCH = "qwen3_next"  # GDN kernels on CPU need bf16
PROMPTS = shared_prefix_prompts(CHUNK_TOKENS[ARCH], seed=1)
#: the prompts without the connector
BASELINE = reference(ARCH, PROMPTS, max_tokens=12, dtype="bfloat16")


def redis_backend(url: str, prefix: str) -> dict[str, Any]:
    return {"type": "redis", "name": "redis", "url": url, "prefix": prefix, "capacity_bytes": "512MiB"}


def peer_backend(address: str) -> dict[str, Any]:
    return {"type": "nixl_peer", "name": "peer", "peers": [address], "capacity_bytes": "512MiB",
            "insecure": True}


def test_prefill_engine_stores_decode_engines_load_from_redis_and_peer(
    model_dir, reference_run, tmp_path: Path
) -> None:
    base = {"model": str(model_dir(ARCH)), "prompts": PROMPTS, "max_tokens": 12,
            "reset_prefix_cache": "request", "llm_kwargs": {"dtype": "bfloat16"}}
    expected = tokens(reference_run(BASELINE), 0)

    (tmp_path / "redis").mkdir()
    server = start_redis_server(tmp_path / "redis")
    peer = start_peer(512 << 20)
    try:
        redis_cfg = redis_backend(server.url, f"e2e-{uuid.uuid4().hex[:8]}")
        peer_cfg = peer_backend(peer.address)
        prefill = run_session_subprocess(
            {**base, "max_tokens": 1, "connector": {"backends": [redis_cfg, peer_cfg]}}
        )
        assert tokens(prefill, 0) == [t[:1] for t in expected]
        stored = prefill["passes"][0]["worker_total"]["backends"]
        assert stored["redis"]["stored_pages"] > 0 and stored["peer"]["stored_pages"] > 0
        assert stored["redis"]["store_failures"] == 0 and stored["peer"]["store_failures"] == 0

        for name, cfg in (("redis", redis_cfg), ("peer", peer_cfg)):
            decode = run_session_subprocess({**base, "connector": {"backends": [cfg]}})
            assert tokens(decode, 0) == expected, name
            assert hit_rate(decode, 0, name) >= 0.99, name
            worker = decode["passes"][0]["worker_total"]
            assert worker["bad_pages"] == 0 and worker["missing_pages"] == 0, name
            assert worker["backends"][name]["loaded_pages"] > 0, name
    finally:
        server.stop()
        peer.kill()
