"""EventSubscriber against vLLM's real ZmqEventPublisher: in-order batches, a router started
after the engine (replay from 0), a lost batch (replayed), an engine restart (its entries
dropped), a gap with no replay socket (resync). Deadlines, no sleeps."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from hybrid_offload.router import CacheIndex, EventSubscriber

HBS = 4


def batch(i: int) -> KVEventBatch:
    """Block ``i`` of a chain of 4-token blocks in the cpu tier (hashes 1000 + i)."""
    event = BlockStored(block_hashes=[1000 + i], parent_block_hash=1000 + i - 1 if i else None,
                        token_ids=[i] * HBS, block_size=HBS, lora_id=None, medium="cpu", lora_name=None,
                        group_idx=0, kv_cache_spec_kind="full_attention", locality="LOCAL")
    return KVEventBatch(ts=float(i), events=[event])


def until(check: Callable[[], bool], sub: EventSubscriber, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out: {sub.stats}"
        sub.poll(0.05)


@pytest.fixture
def endpoints(tmp_path: Path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"


@pytest.fixture
def publishers(endpoints) -> Iterator[Callable[..., ZmqEventPublisher]]:
    made: list[ZmqEventPublisher] = []

    def make(replay: bool = True) -> ZmqEventPublisher:
        replay_endpoint = endpoints[1] if replay else None
        made.append(ZmqEventPublisher(0, endpoint=endpoints[0], replay_endpoint=replay_endpoint))
        return made[-1]

    yield make
    for p in made:
        p.shutdown()


def held(index: CacheIndex) -> set[int]:
    return {h for blocks in index._blocks.values() for h in blocks.hashes}


def connect(sub: EventSubscriber, pub: ZmqEventPublisher, first: int) -> int:
    """Publish batches from ``first`` until the subscriber has one (ZMQ drops what a PUB sends
    before a SUB joined); the next batch number."""
    i = first
    deadline = time.monotonic() + 20
    while sub.stats.batches == 0:
        assert time.monotonic() < deadline
        pub.publish(batch(i))
        i += 1
        sub.poll(0.1)
    return i


def test_a_late_router_replays_from_zero_then_follows(endpoints, publishers) -> None:
    pub = publishers()
    index = CacheIndex(hash_block_size=HBS)
    for i in range(3):  # before anyone listens
        pub.publish(batch(i))
    deadline = time.monotonic() + 20
    while len(pub._buffer) < 3:  # sent (to no one), kept for replay
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sub = EventSubscriber(index, "e", endpoints[0], replay_endpoint=endpoints[1], bind=False)
    try:
        n = connect(sub, pub, 3)
        for i in range(n, n + 3):
            pub.publish(batch(i))
        until(lambda: sub.stats.batches >= n + 3, sub)
        assert held(index) == {1000 + i for i in range(n + 3)}
        assert sub.stats.replayed >= 3 and sub.stats.gaps == 0 and sub.stats.resyncs == 0
    finally:
        sub.close()


def test_a_lost_batch_is_replayed_and_a_restart_resets(endpoints, publishers) -> None:
    pub = publishers()
    index = CacheIndex(hash_block_size=HBS)
    sub = EventSubscriber(index, "e", endpoints[0], replay_endpoint=endpoints[1], bind=False)
    try:
        n = connect(sub, pub, 0)
        real = pub._pub
        assert real is not None

        class DropOne:
            def send_multipart(self, frames):  # type: ignore[no-untyped-def]
                if int.from_bytes(frames[1], "big") != n:
                    real.send_multipart(frames)

        pub._pub = DropOne()  # type: ignore[assignment]
        for i in range(n, n + 3):
            pub.publish(batch(i))
        until(lambda: 1000 + n + 2 in held(index), sub)
        assert 1000 + n in held(index)  # the dropped one came through the replay socket
        assert sub.stats.gaps == 1 and sub.stats.resyncs == 0
        pub._pub = real
        pub.shutdown()

        pub = publishers()  # the engine restarted: sequence numbers from 0 again
        connect_from = sub.stats.batches
        deadline = time.monotonic() + 20
        i = 500
        while sub.stats.restarts == 0:
            assert time.monotonic() < deadline
            pub.publish(batch(i))
            i += 1
            sub.poll(0.1)
        assert sub.stats.batches > connect_from
        assert 1000 + n not in held(index) and min(held(index)) >= 1500  # the old entries dropped
    finally:
        sub.close()


def test_a_gap_without_replay_resyncs(endpoints, publishers) -> None:
    pub = publishers(replay=False)
    index = CacheIndex(hash_block_size=HBS)
    sub = EventSubscriber(index, "e", endpoints[0], bind=False)
    try:
        n = connect(sub, pub, 0)
        real = pub._pub

        class DropOne:
            def send_multipart(self, frames):  # type: ignore[no-untyped-def]
                if int.from_bytes(frames[1], "big") != n:
                    real.send_multipart(frames)

        pub._pub = DropOne()  # type: ignore[assignment]
        for i in range(n, n + 2):
            pub.publish(batch(i))
        until(lambda: sub.stats.resyncs == 1, sub)
        pub._pub = real
        assert held(index) == {1000 + n + 1}  # what came before the gap is dropped
    finally:
        sub.close()


def test_bind_side_follows_the_engines_endpoint(tmp_path: Path) -> None:
    index = CacheIndex(hash_block_size=HBS)
    sub = EventSubscriber(index, "e", "tcp://127.0.0.1:0")  # port 0: we bind, the engine connects
    pub = ZmqEventPublisher(0, endpoint=sub.endpoint)
    try:
        assert sub.endpoint.startswith("tcp://127.0.0.1:") and not sub.endpoint.endswith(":0")
        connect(sub, pub, 0)
        assert sub.stats.malformed == 0
    finally:
        pub.shutdown()
        sub.close()
