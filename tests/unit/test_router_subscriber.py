"""EventSubscriber against vLLM's real ZmqEventPublisher: a router started after the engine
(replayed from 0), in-order batches, lost batches (a lossy relay drops chosen sequence numbers:
replayed, or a resync when the engine's buffer no longer has them or it has no replay socket),
an engine restart (its entries dropped, even when the new stream's first batches were missed),
malformed messages, and both bind directions. No fixed sleeps: every wait polls a condition under
a deadline. ipc endpoints in tmp_path
and tcp port 0, so parallel runs do not collide."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from hybrid_offload.router import CacheIndex, EventSubscriber, block_hashes, external
from hybrid_offload.router.subscriber import engine_binds, reachable
from hybrid_offload.testing.deadlines import wait_until

HBS = 4
DEADLINE_S = 20.0


def prompt(i: int) -> list[int]:
    """Batch ``i``'s prompt: one block of its own, then a token to compute."""
    return [i, i + 1, i + 2, i + 3, 7]


def batch(i: int) -> KVEventBatch:
    """Our event for the first block of ``prompt(i)`` in the cpu tier."""
    tokens = prompt(i)[:HBS]
    event = BlockStored(block_hashes=[external(block_hashes(tokens, HBS)[0])], parent_block_hash=None,
                        token_ids=tokens, block_size=HBS, lora_id=None, medium="cpu", lora_name=None,
                        group_idx=0, kv_cache_spec_kind="full_attention", locality="LOCAL")  # fmt: skip
    return KVEventBatch(ts=float(i), events=[event])


def held(index: CacheIndex, batches: range) -> set[int]:
    """The batches whose block the index holds."""
    return {i for i in batches if index.restorable("e", prompt(i)).get("cpu") == HBS}


def until(check: Callable[[], bool], *pump: Callable[[], object]) -> None:
    """Wait until ``check()``, running each of ``pump`` between checks (they block briefly)."""
    wait_until(check, "the condition", timeout_s=DEADLINE_S, between=lambda: [step() for step in pump])


class Relay:
    """A lossy network between the engine and the router: forwards the engine's messages,
    dropping the sequence numbers in ``drop`` (or sending ``replace[seq]`` frames instead)."""

    def __init__(self, source: str, target: str) -> None:
        ctx = zmq.Context.instance()
        self.target = target
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(source)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(target)
        self.drop: set[int] = set()
        self.replace: dict[int, list[bytes]] = {}
        self.last = -1

    def pump(self) -> None:
        while self.sub.poll(20):
            frames = self.sub.recv_multipart()
            self.last = seq = int.from_bytes(frames[1], "big")
            if seq in self.replace:
                self.pub.send_multipart(self.replace[seq])
            elif seq not in self.drop:
                self.pub.send_multipart(frames)

    def reopen(self) -> None:
        """Drop the router's connection (as a dying engine does) and listen again."""
        self.pub.close(linger=0)
        self.pub = zmq.Context.instance().socket(zmq.PUB)
        self.pub.bind(self.target)
        self.last = -1

    def reach(self, sub: EventSubscriber) -> None:
        """Send one-frame probes until the router got one (it counts them as malformed)."""
        probes = sub.stats.malformed
        until(lambda: sub.stats.malformed > probes, lambda: self.pub.send(b"probe"), lambda: sub.poll(0.05))

    def close(self) -> None:
        self.sub.close(linger=0)
        self.pub.close(linger=0)


@pytest.fixture
def ipc(tmp_path: Path) -> Callable[[str], str]:
    return lambda name: f"ipc://{tmp_path}/{name}"


@pytest.fixture
def closing() -> Iterator[list]:
    """Publishers, relays and subscribers to shut down after the test."""
    things: list = []
    yield things
    for thing in reversed(things):
        thing.shutdown() if isinstance(thing, ZmqEventPublisher) else thing.close()


def replayable(replay_endpoint: str, n: int) -> None:
    """Wait until the engine has sent (and buffered) batches 0 .. n-1, asking its replay socket
    as any client would: ``[b"", start]`` -> ``[b"", topic, seq, payload]``... ``seq == -1``."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay_endpoint)

    def all_sent() -> bool:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert dealer.poll(int(DEADLINE_S * 1000)), "no replay answer"
            empty, _topic, seq, _payload = dealer.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            seqs.append(int.from_bytes(seq, "big"))
        if seqs == list(range(n)):
            return True
        assert len(seqs) < n, seqs
        return False

    try:
        wait_until(all_sent, f"batches 0..{n - 1} replayable", timeout_s=DEADLINE_S)
    finally:
        dealer.close(linger=0)


MARK = 1000  # a batch that says everything published before it was processed


def join(pub: ZmqEventPublisher, sub: EventSubscriber, *pump: Callable[[], object]) -> None:
    """Publish empty batches until the router got one (ZMQ drops what a PUB sends before a SUB
    joined; the router replays what it missed), then a mark, and wait for it: every batch
    published so far is processed."""
    until(lambda: sub.stats.batches > 0, lambda: pub.publish(KVEventBatch(ts=0.0, events=[])), *pump,
          lambda: sub.poll(0.05))  # fmt: skip
    pub.publish(batch(MARK))
    until(lambda: held(sub.index, range(MARK, MARK + 1)) == {MARK}, *pump, lambda: sub.poll(0.05))


def test_a_late_router_replays_from_zero_then_follows_in_order(ipc, closing) -> None:
    pub = ZmqEventPublisher(0, endpoint=ipc("pub"), replay_endpoint=ipc("replay"))
    closing.append(pub)
    for i in range(3):  # before anyone listens
        pub.publish(batch(i))
    replayable(ipc("replay"), 3)
    index = CacheIndex(hash_block_size=HBS)
    sub = EventSubscriber(index, "e", ipc("pub"), replay_endpoint=ipc("replay"))  # vLLM binds ipc: we connect
    closing.append(sub)
    join(pub, sub)
    assert held(index, range(3)) == {0, 1, 2} and sub.stats.replayed >= 3
    before = sub.stats.batches
    for i in range(3, 8):
        pub.publish(batch(i))
    until(lambda: sub.stats.batches == before + 5, lambda: sub.poll(0.05))
    assert held(index, range(8)) == set(range(8))
    assert (sub.stats.gaps, sub.stats.resyncs, sub.stats.restarts, sub.stats.malformed) == (0, 0, 0, 0)
    assert sub.stats.events == 9  # 8 blocks and the mark


def relayed(pub: ZmqEventPublisher, relay: Relay, batches: range) -> None:
    """Publish ``batches`` and let the relay pass them all on before the router reads any."""
    target = relay.last + len(batches)
    for i in batches:
        pub.publish(batch(i))
    until(lambda: relay.last == target, relay.pump)


@pytest.mark.parametrize("buffer_steps", [10_000, 2])
def test_lost_batches_are_replayed_or_resynced(ipc, closing, buffer_steps) -> None:
    pub = ZmqEventPublisher(0, endpoint=ipc("pub"), replay_endpoint=ipc("replay"), buffer_steps=buffer_steps)
    relay = Relay(ipc("pub"), ipc("relay"))
    index = CacheIndex(hash_block_size=HBS)
    sub = EventSubscriber(index, "e", ipc("relay"), replay_endpoint=ipc("replay"))
    closing += [pub, relay, sub]
    join(pub, sub, relay.pump)
    resyncs, first = sub.stats.resyncs, relay.last + 1  # the sequence number of batch(0)
    relay.drop = {first + 1, first + 2, first + 3}
    relayed(pub, relay, range(6))
    until(lambda: 5 in held(index, range(6)), lambda: sub.poll(0.05))
    assert sub.stats.gaps == 1
    if buffer_steps > 3:  # the engine still had them
        assert held(index, range(6)) == set(range(6))
        assert sub.stats.resyncs == resyncs and sub.stats.replayed >= 3
    else:  # the engine kept the last 2 (4 and 5): the index drops all it had, goes on from 4
        assert held(index, range(6)) == {4, 5} and MARK not in held(index, range(MARK, MARK + 1))
        assert sub.stats.resyncs == resyncs + 1


def test_a_gap_without_replay_resyncs_and_malformed_messages_are_skipped(ipc, closing) -> None:
    pub = ZmqEventPublisher(0, endpoint=ipc("pub"))
    relay = Relay(ipc("pub"), ipc("relay"))
    index = CacheIndex(hash_block_size=HBS)
    sub = EventSubscriber(index, "e", ipc("relay"))
    closing += [pub, relay, sub]
    join(pub, sub, relay.pump)
    resyncs, first = sub.stats.resyncs, relay.last + 1  # a resync if the router missed seq 0
    relay.replace = {first + 1: [b"", (first + 1).to_bytes(8, "big"), b"\xc1"]}  # not msgpack
    relay.drop = {first + 3}
    relayed(pub, relay, range(5))
    relay.pub.send_multipart([b"", b"short"])  # no 8-byte sequence number
    until(lambda: sub.stats.malformed == 2, lambda: sub.poll(0.05))
    assert held(index, range(5)) == {4}  # what came before the gap is dropped
    assert (sub.stats.gaps, sub.stats.resyncs - resyncs) == (1, 1)


def test_an_engine_restart_drops_its_entries(ipc, closing) -> None:
    pub = ZmqEventPublisher(0, endpoint=ipc("pub"), replay_endpoint=ipc("replay"))
    index = CacheIndex(hash_block_size=HBS)
    sub = EventSubscriber(index, "e", ipc("pub"), replay_endpoint=ipc("replay"))
    closing.append(sub)
    join(pub, sub)
    for i in range(5):
        pub.publish(batch(i))
    until(lambda: held(index, range(5)) == set(range(5)), lambda: sub.poll(0.05))
    pub.shutdown()
    new = ZmqEventPublisher(0, endpoint=ipc("pub"), replay_endpoint=ipc("replay"))  # seq from 0 again
    closing.append(new)
    i = 100
    while sub.stats.restarts == 0:  # the router may miss the new stream's first batches
        assert i < 500, sub.stats
        new.publish(batch(i))
        i += 1
        sub.poll(0.05)
    until(lambda: held(index, range(100, i)) == set(range(100, i)), lambda: sub.poll(0.05))
    assert held(index, range(5)) == set()  # the old process's blocks are gone
    assert sub.stats.restarts == 1


def test_a_restart_whose_first_batches_were_missed_is_still_detected(ipc, closing) -> None:
    """The router reconnects to a restarted engine whose stream is at its last sequence number
    + 1 (it missed the rest): the lost connection makes it check the engine's copy of its last
    batch, which is another one."""
    pub = ZmqEventPublisher(0, endpoint=ipc("pub"), replay_endpoint=ipc("replay"))
    relay = Relay(ipc("pub"), ipc("relay"))
    index = CacheIndex(hash_block_size=HBS)
    sub = EventSubscriber(index, "e", ipc("relay"), replay_endpoint=ipc("replay"))
    closing += [relay, sub]
    join(pub, sub, relay.pump)
    relayed(pub, relay, range(5))
    until(lambda: held(index, range(5)) == set(range(5)), lambda: sub.poll(0.05))
    last = relay.last
    pub.shutdown()
    relay.drop = set(range(last + 1))  # the new stream up to ``last``: missed
    relay.reopen()  # the router sees its connection drop
    new = ZmqEventPublisher(0, endpoint=ipc("pub"), replay_endpoint=ipc("replay"))
    closing.append(new)
    relay.reach(sub)  # reconnected (the probes leave the lost connection noted)
    # one at a time: the router's first batch of it is ``last + 1``
    until(lambda: relay.last >= last, lambda: new.publish(KVEventBatch(ts=1.0, events=[])), relay.pump)
    relayed(new, relay, range(100, 103))
    until(lambda: held(index, range(100, 103)) == {100, 101, 102}, lambda: sub.poll(0.05))
    assert sub.stats.restarts == 1 and sub.stats.gaps == 0
    assert held(index, range(5)) == set()  # the old process's blocks are gone


def test_the_bind_side_follows_the_engines_endpoint(ipc, closing) -> None:
    assert engine_binds("tcp://*:5557") and engine_binds("ipc:///tmp/x") and engine_binds("tcp://[::]:1")
    assert not engine_binds("tcp://127.0.0.1:5557") and not engine_binds("tcp://10.0.0.2:5557")
    assert reachable("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert reachable("tcp://[::]:5557") == "tcp://[::1]:5557"
    assert reachable("tcp://10.0.0.2:5557") == "tcp://10.0.0.2:5557"

    index = CacheIndex(hash_block_size=HBS)
    sub = EventSubscriber(index, "e", "tcp://127.0.0.1:0", replay_endpoint=ipc("replay"))  # vLLM connects
    closing.append(sub)
    assert sub.endpoint.startswith("tcp://127.0.0.1:") and not sub.endpoint.endswith(":0")
    pub = ZmqEventPublisher(0, endpoint=sub.endpoint, replay_endpoint=ipc("replay"))
    closing.append(pub)
    join(pub, sub)
    with pytest.raises(zmq.ZMQError):  # told to bind where another binds: the address is taken
        EventSubscriber(CacheIndex(), "e", sub.endpoint, bind=True)

    index2 = CacheIndex(hash_block_size=HBS)  # vLLM binds ipc: we connect
    pub2 = ZmqEventPublisher(0, endpoint=ipc("pub2"))
    closing.append(pub2)
    sub2 = EventSubscriber(index2, "e", ipc("pub2"))
    closing.append(sub2)
    join(pub2, sub2)
    pub2.publish(batch(1))
    until(lambda: held(index2, range(2)) == {1}, lambda: sub2.poll(0.05))


def test_a_daemon_thread_feeds_the_index(ipc, closing) -> None:
    pub = ZmqEventPublisher(0, endpoint=ipc("pub"))
    closing.append(pub)
    arrived = threading.Event()
    index = CacheIndex(hash_block_size=HBS)
    sub = EventSubscriber(index, "e", ipc("pub"), on_events=lambda events: arrived.set())
    closing.append(sub)
    sub.start()
    until(lambda: held(index, range(1)) == {0}, lambda: pub.publish(batch(0)), lambda: arrived.wait(0.05))
    sub.stop()
    assert sub.stats.malformed == 0 and sub.stats.batches >= 1


def test_nothing_a_message_holds_stops_the_subscriber(ipc, closing, monkeypatch) -> None:
    """Issue 45 N5: a 2 KB nested payload (RecursionError) or a huge sequence number (a replay
    request sized by it: MemoryError) killed the subscriber's thread for good, the index then
    silently stale. Now: the nested one is malformed, the huge number a resync (the engine's next
    batch then reads as a restart and is replayed), an error inside the index an ``errors``
    resync, a message over MAX_MESSAGE_BYTES refused by ZMQ; the daemon thread feeds the index on."""
    from hybrid_offload.router import subscriber as subscriber_module

    monkeypatch.setattr(subscriber_module, "MAX_MESSAGE_BYTES", 64 << 10)
    pub = ZmqEventPublisher(0, endpoint=ipc("pub"), replay_endpoint=ipc("replay"))
    relay = Relay(ipc("pub"), ipc("relay"))
    index = CacheIndex(hash_block_size=HBS)
    sub = EventSubscriber(index, "e", ipc("relay"), replay_endpoint=ipc("replay"))
    closing += [pub, relay, sub]
    join(pub, sub, relay.pump)
    first = relay.last + 1
    nested = b"\x91" * 2000 + b"\xc0"  # [[[...[nil]...]]]: msgpack, 2,000 deep
    relay.replace = {first: [b"", first.to_bytes(8, "big"), nested]}
    relayed(pub, relay, range(1))
    until(lambda: sub.stats.malformed == 1, lambda: sub.poll(0.05))

    calls = []
    real_apply = index.apply

    def failing_apply(engine, events):  # an index that fails once
        calls.append(engine)
        if len(calls) == 1:
            raise RuntimeError("index broke")
        return real_apply(engine, events)

    monkeypatch.setattr(index, "apply", failing_apply)
    relayed(pub, relay, range(1, 2))
    until(lambda: sub.stats.errors == 1, lambda: sub.poll(0.05))

    relay.pub.send_multipart([b"", (1 << 62).to_bytes(8, "big"), b"\x93\x00\x90\xc0"])  # [0, [], nil]
    sub.start()
    relayed(pub, relay, range(2, 6))
    # the engine goes on publishing; the first batch that arrives reads as a restart (its number
    # is below the forged one), and the replay brings back 2-5
    until(lambda: held(index, range(2, 6)) == {2, 3, 4, 5}, lambda: relayed(pub, relay, range(6, 7)))
    sub.stop()
    assert sub.stats.malformed == 1 and sub.stats.errors == 1 and sub.stats.restarts >= 1


def test_a_bound_router_refuses_oversized_messages_and_hears_the_engine_on(closing, monkeypatch) -> None:
    """Where the router binds (loopback tcp), any local user can connect and publish: a message
    over MAX_MESSAGE_BYTES drops that sender's connection (ZMQ), not the engine's."""
    from hybrid_offload.router import subscriber as subscriber_module

    monkeypatch.setattr(subscriber_module, "MAX_MESSAGE_BYTES", 64 << 10)
    index = CacheIndex(hash_block_size=HBS)
    sub = EventSubscriber(index, "e", "tcp://127.0.0.1:0")  # binds
    pub = ZmqEventPublisher(0, endpoint=sub.endpoint)  # the engine connects
    closing += [pub, sub]
    join(pub, sub)
    attacker = zmq.Context.instance().socket(zmq.PUB)
    closing.append(attacker)
    attacker.connect(sub.endpoint)
    until(lambda: sub.stats.malformed > 0, lambda: attacker.send(b"probe"), lambda: sub.poll(0.05))
    probes = sub.stats.malformed  # the attacker is connected: what it sends arrives
    attacker.send_multipart([b"", (1).to_bytes(8, "big"), b"x" * (128 << 10)])
    pub.publish(batch(7))
    until(lambda: held(index, range(7, 8)) == {7}, lambda: sub.poll(0.05))
    assert sub.stats.malformed == probes and sub.stats.errors == 0  # never reached the decoder
