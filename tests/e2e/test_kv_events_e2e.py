"""KV events end to end: a multi-process engine publishes through vLLM's ZMQ channel, our router
index subscribes, and what it says is restorable is what the next chat turn gets.

One engine (float32 nemotron_h, vLLM's default multi-process engine) with a small cpu tier (it
evicts) and a disk tier, KV events on. Turn 1 of three chats (prompts of arbitrary lengths);
between the turns the test reads the events, checks them, builds each chat's turn 2 from turn 1's
prompt, its generated reply and a new message, and asks the index how much of it the engine can
restore from each tier. Turn 2 then runs with vLLM's own prefix cache emptied, so every cached
token came from a tier: it must be what the index said, within one chunk. The connector runs with
``kv_events_token_ids: false``: the tiers' events carry hashes only (no prompt text), and the
index still predicts (it needs only hashes; it learns vLLM's hash block size from vLLM's own
GPU events).
"""

from __future__ import annotations

import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from engine_runs import release_pass, wait_for_pass

from hybrid_offload.core.kv_events import medium_name
from hybrid_offload.router import CacheIndex, EventSubscriber, Removed, Stored
from hybrid_offload.testing.session import run_session_subprocess

pytestmark = pytest.mark.e2e

ARCH = "nemotron_h"
CHUNK = 128
MP_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_quiet(sub: EventSubscriber, seconds: float = 3.0, timeout: float = 60.0) -> None:
    """Poll until no batch arrived for ``seconds`` (the engine settled its stores)."""
    deadline, last, seen = time.monotonic() + timeout, time.monotonic(), sub.stats.batches
    while time.monotonic() < deadline:
        sub.poll(0.2)
        if sub.stats.batches != seen:
            seen, last = sub.stats.batches, time.monotonic()
        elif time.monotonic() - last >= seconds:
            return
    raise AssertionError("the engine kept publishing events")


def test_events_name_tiers_and_kinds_and_the_index_predicts_the_next_turn(model_dir, tmp_path: Path) -> None:
    rng = random.Random(34)
    turn1 = [[rng.randrange(3, 2048) for _ in range(rng.randrange(300, 700))] for _ in range(3)]
    index = CacheIndex()
    seen: list[Any] = []
    sub = EventSubscriber(  # binds: vLLM connects to a non-wildcard endpoint
        index, "engine", "tcp://127.0.0.1:0", replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
        on_events=seen.extend,
    )
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    spec = {
        "model": str(model_dir(ARCH)), "prompts": turn1, "max_tokens": 24, "passes": 2,
        "pass_barrier": str(barrier),
        "llm_kwargs": {
            "dtype": "float32", "enable_prefix_caching": True,
            "kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": sub.endpoint, "replay_endpoint": sub.replay_endpoint},
        },
        "connector": {"kv_events_token_ids": False, "backends": [
            {"type": "cpu", "name": "cpu", "capacity_bytes": "1MiB"},
            {"type": "disk", "name": "disk", "capacity_bytes": "256MiB", "path": str(tmp_path / "disk")},
        ]},
    }
    try:
        with ThreadPoolExecutor(1) as pool:
            session = pool.submit(run_session_subprocess, spec, 900, MP_ENV)
            while not (barrier / "pass-0.done").exists():
                sub.poll(0.5)
                if session.done():
                    session.result()
            wait_for_pass(barrier, 0, session)
            wait_quiet(sub)

            stored = [e for e in seen if isinstance(e, Stored)]
            removed = [e for e in seen if isinstance(e, Removed)]
            disk = medium_name("disk", "disk", {"path": str(tmp_path / "disk")})  # a shared tier: its store
            tiers = {(e.medium, e.kind, e.locality) for e in stored if e.medium != "GPU"}
            assert {("cpu", "full_attention", "LOCAL"), ("cpu", "mamba", "LOCAL"),
                    (disk, "full_attention", "REMOTE"), (disk, "mamba", "REMOTE")} <= tiers
            assert any(e.medium == "cpu" for e in removed), "the 1 MiB cpu tier evicted nothing"
            assert all(not e.token_ids for e in stored if e.medium != "GPU")  # hashes only
            assert any(e.token_ids for e in stored if e.medium == "GPU")  # vLLM's own carry them
            assert sub.stats.gaps == 0 and sub.stats.malformed == 0

            replies = [r["tokens"] for r in json.loads((barrier / "pass-0.done").read_text())["requests"]]
            turn2 = [p + out + [rng.randrange(3, 2048) for _ in range(rng.randrange(20, 150))]
                     for p, out in zip(turn1, replies, strict=True)]
            predicted, media_seen = [], []
            for prompt in turn2:
                media = index.restorable("engine", prompt)
                media_seen.append(media)
                predicted.append(max((t for m, t in media.items() if m != "GPU"), default=0))
            (barrier / "pass-0.prompts.json").write_text(json.dumps(turn2))
            release_pass(barrier, 0)
            result = session.result()
    finally:
        sub.close()

    got = [r["cached_tokens"] for r in result["passes"][1]["requests"]]
    assert all(p > 0 for p in predicted), (predicted, got, [len(p) for p in turn1], media_seen)
    for want, have in zip(predicted, got, strict=True):
        assert abs(want - have) <= CHUNK, (predicted, got)
