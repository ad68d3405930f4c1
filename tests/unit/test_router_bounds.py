"""Issue 45 (trust, third round): what a forged KV event stream can do to the router.

* N6: the index's state is bounded per holder (tier media per engine, group indices, names,
  pools) and decoding one payload holds a small multiple of its size (untyped msgpack held up to
  76 times: nested empty arrays); routing stays fast under a flood.
* N7: the learned hash block size comes from vLLM's own GPU events only and follows what most
  recent ones agree on, so one forged event (or a flood) does not fix it for good.
* N14: shared tiers are pooled by store, not by name: ``<name>@<store id>``
  (:func:`hybrid_offload.core.kv_events.medium_name`); weights may still name the tier.

Every test here fails on the code before the fix (the one of N7's salt is in test_tier_events).
"""

from __future__ import annotations

import random
import tracemalloc

import msgspec
import pytest

from hybrid_offload.core.kv_events import medium_name, store_location
from hybrid_offload.router import (
    CacheIndex,
    MalformedBatchError,
    Removed,
    Stored,
    block_hashes,
    decode_batch,
    external,
)
from hybrid_offload.router import events as wire
from hybrid_offload.router.index import LEARN_WINDOW, MAX_GROUPS, MAX_MEDIA

HBS = 16
ATTN, STATE = 0, 1


def prompt_of(seed: int, blocks: int = 8) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(HBS * blocks + 5)]


def chain(tokens: list[int], size: int = HBS) -> list[int]:
    return [external(h) for h in block_hashes(tokens, size)]  # type: ignore[misc]


def gpu(tokens: list[int], blocks: int, size: int = HBS, medium: str | None = "GPU") -> Stored:
    """vLLM's own GPU event (as an engine hashing every ``size`` tokens publishes it)."""
    hashes, covered = tuple(chain(tokens, size)[:blocks]), tuple(tokens[: blocks * size])
    return Stored(hashes, None, covered, size, medium, ATTN, None, None, None, None)


def tier(tokens: list[int], end: int, medium: str, group: int = ATTN, locality: str | None = "LOCAL",
         kind: str = "full_attention") -> Stored:  # fmt: skip
    """Our event: the block of HBS tokens ending at ``end``."""
    h = chain(tokens)
    parent = h[end // HBS - 2] if end > HBS else None
    owner = "hybrid-offload"
    return Stored((h[end // HBS - 1],), parent, (), HBS, medium, group, kind, None, locality, owner)


# ---- N6: bounded state ------------------------------------------------------------------------
def test_a_forged_stream_cannot_grow_the_index_without_bound() -> None:
    """Before: every medium name, group index and pooled name was kept (a flood of 200 media x
    20 groups kept 122 MB and made one route() take 870 ms instead of 0.6 ms)."""
    prompt = prompt_of(1)
    index = CacheIndex(hash_block_size=HBS)
    index.apply("a", [gpu(prompt, 4)] + [tier(prompt, e, "cpu") for e in range(16, 97, 16)])
    assert index.restorable("a", prompt) == {"GPU": 64, "cpu": 96}

    forged = [
        tier(prompt, e, f"forged-{m}", locality="REMOTE" if m % 2 else "LOCAL")
        for m in range(3 * MAX_MEDIA) for e in (16, 32)
    ]  # fmt: skip
    refused = [
        tier(prompt, 16, "x", group=MAX_GROUPS),  # a group index out of range
        tier(prompt, 16, "x", group=-1),
        tier(prompt, 16, "m" * (wire.MAX_NAME + 1)),  # a name too long
        tier(prompt, 16, "x", kind="k" * (wire.MAX_NAME + 1)),
        Removed((1,), "x", 1 << 40, "REMOTE", None),
    ]
    index.apply("a", forged + refused)
    media = index.restorable("a", prompt)
    assert len(media) == MAX_MEDIA + 1 and media["GPU"] == 64  # its GPU is never dropped
    assert index.stats.media_dropped == 2 * MAX_MEDIA + 1  # cpu went first, then forged ones
    assert index.stats.events_refused == len(refused)
    assert len(index._media) <= MAX_MEDIA + 1 and len(index._readers) <= MAX_MEDIA  # pools die unread
    assert max(index._kinds["a"]) < MAX_GROUPS

    index.apply("a", [tier(prompt, e, "cpu") for e in range(16, 97, 16)])  # the engine's own again
    assert index.restorable("a", prompt)["cpu"] == 96
    assert index.route(prompt, ["a"]) == "a"


def test_a_pool_no_engine_reads_any_more_is_dropped() -> None:
    prompt = prompt_of(2)
    index = CacheIndex(hash_block_size=HBS, max_media=2)
    index.apply("a", [tier(prompt, 16, "disk@1", locality="REMOTE")])
    index.apply("b", [tier(prompt, 16, "disk@1", locality="REMOTE")])
    index.apply("a", [tier(prompt, 16, f"t{i}", locality="REMOTE") for i in range(2)])  # a drops disk@1
    assert "disk@1" in index._readers and index.restorable("b", prompt) == {"disk@1": 16}
    index.apply("b", [tier(prompt, 16, f"u{i}", locality="REMOTE") for i in range(2)])  # b too: gone
    assert "disk@1" not in index._readers and (None, "disk@1") not in index._media


def _payload(*events: dict) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


def _stored(**fields: object) -> dict:
    return {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [],
            "block_size": 16, "lora_id": None, "medium": None, "lora_name": None, **fields}  # fmt: skip


N = 1 << 17
AMPLIFIERS = {
    "nested arrays in an unknown field": _payload(_stored(future=[[]] * N)),
    "nested arrays as extra keys": _payload(_stored(extra_keys=[[]] * N)),
    "many tiny unknown events": _payload(*[{"type": ""}] * N),
    "many token ids": _payload(_stored(token_ids=[1] * N)),
    "many small hashes": _payload(_stored(block_hashes=[300] * N)),
    "many clears": _payload(*[{"type": "AllBlocksCleared"}] * N),
    "many empty removals": _payload(*[{"type": "BlockRemoved", "block_hashes": []}] * N),
}


@pytest.mark.parametrize("name", list(AMPLIFIERS))
def test_decoding_one_payload_holds_a_small_multiple_of_its_size(name: str) -> None:
    """Before: 65 and 73 times for nested arrays, 25 for token ids, 28 for tiny events."""
    payload = AMPLIFIERS[name]
    tracemalloc.start()
    try:
        batch = decode_batch(payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 17 * len(payload), f"{name}: {peak / len(payload):.1f} times its size"
    assert len(batch.events) in (0, 1, N)


def test_a_vllm_batch_decodes_in_a_few_times_its_size() -> None:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    rng = random.Random(3)
    events = [
        BlockStored(block_hashes=[rng.getrandbits(64) for _ in range(16)], parent_block_hash=None,
                    token_ids=[rng.randrange(150_000) for _ in range(256)], block_size=16, lora_id=None,
                    medium=None, lora_name=None, extra_keys=[None] * 16, group_idx=0)
        for _ in range(64)
    ]  # fmt: skip
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=events))
    tracemalloc.start()
    try:
        batch = decode_batch(payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 4 * len(payload) and len(batch.events) == 64


def test_limits_refuse_a_payload_before_building_it(monkeypatch: pytest.MonkeyPatch) -> None:
    n = wire.MAX_EVENTS + 1
    too_many = b"\x93" + msgspec.msgpack.encode(1.0) + b"\xdd" + n.to_bytes(4, "big")
    too_many += msgspec.msgpack.encode({"type": ""}) * n + b"\x00"
    with pytest.raises(MalformedBatchError, match="length"):
        decode_batch(too_many)  # before: a million dicts built, then skipped
    with pytest.raises(MalformedBatchError):
        decode_batch(_payload(_stored(block_hashes=[-1])))
    with pytest.raises(MalformedBatchError):
        decode_batch(_payload(_stored(medium="m" * (wire.MAX_NAME + 1))))
    monkeypatch.setattr(wire, "MAX_BATCH_HASHES", 10)
    decode_batch(_payload(*[_stored(block_hashes=[1, 2])] * 5))
    with pytest.raises(MalformedBatchError, match="hashes"):
        decode_batch(_payload(*[_stored(block_hashes=[1, 2])] * 6))


def test_token_ids_stay_msgpack_until_read() -> None:
    (event,) = decode_batch(_payload(_stored(token_ids=list(range(1000)), extra_keys=[None]))).events
    assert isinstance(event, Stored) and not event.has_extra_keys
    assert len(event.token_ids) == 1000 and event.token_ids._values is None  # type: ignore[attr-defined]
    assert event.token_ids[:3] == (0, 1, 2) and event.token_ids == tuple(range(1000))
    (bad,) = decode_batch(_payload(_stored(token_ids=["x"] * 32, block_size=32))).events
    assert len(bad.token_ids) == 32
    with pytest.raises(MalformedBatchError):
        list(bad.token_ids)
    index = CacheIndex()
    index.apply("a", [bad])  # learning skips it; nothing raises
    assert index.hash_block_size is None and index.stats.learn_failures == 0


# ---- N7: the hash block size ------------------------------------------------------------------
def test_one_forged_event_does_not_fix_the_hash_block_size() -> None:
    """Before: the first event that started a prefix set it for good."""
    index = CacheIndex()
    forged = prompt_of(10)
    index.apply("a", [gpu(forged, 1, size=32)])  # hashed every 32 tokens: a lie about this engine
    assert index.hash_block_size == 32
    prompts = [prompt_of(20 + i) for i in range(3)]
    index.apply("a", [gpu(prompts[0], 2)])
    assert index.hash_block_size == 32  # one vote each: the current value stays
    index.apply("a", [gpu(prompts[1], 2)])
    assert index.hash_block_size == HBS and index.stats.relearned == 1
    index.apply("a", [gpu(prompts[2], 4)])
    assert index.restorable("a", prompts[2]) == {"GPU": 64}


def test_a_flood_of_forged_events_is_outvoted_once_it_stops() -> None:
    index = CacheIndex()
    index.apply("a", [gpu(prompt_of(1), 2)])
    for i in range(3 * LEARN_WINDOW):  # one lesson per applied batch
        index.apply("a", [gpu(prompt_of(100 + i), 1, size=32)])
    assert index.hash_block_size == 32
    for i in range(LEARN_WINDOW // 2 + 1):
        index.apply("a", [gpu(prompt_of(200 + i), 2)])
    assert index.hash_block_size == HBS


def test_only_vllms_own_gpu_events_teach() -> None:
    index = CacheIndex()
    lie = prompt_of(5)
    for medium in ("cpu", "disk@x"):  # our tiers' events (or forged ones naming a tier)
        index.apply("a", [gpu(lie, 1, size=32, medium=medium)])
    assert index.hash_block_size is None
    index.apply("a", [gpu(prompt_of(6), 2, medium=None)])  # vLLM's GPU: medium None or "GPU"
    assert index.hash_block_size == HBS
    given = CacheIndex(hash_block_size=HBS)
    for i in range(LEARN_WINDOW):
        given.apply("a", [gpu(prompt_of(300 + i), 1, size=32)])
    assert given.hash_block_size == HBS  # given: never learned


def test_events_no_size_reproduces_never_stop_learning() -> None:
    """Before: 16 such events (garbage hashes) stopped learning for good."""
    index = CacheIndex()
    rng = random.Random(7)
    for _ in range(3 * LEARN_WINDOW):
        index.apply("a", [Stored((rng.getrandbits(64),), None, tuple(range(32)), 32, "GPU", 0, None, None,
                                 None, None)])  # fmt: skip
    assert index.hash_block_size is None and index.stats.learn_failures == 3 * LEARN_WINDOW
    index.apply("a", [gpu(prompt_of(8), 2)])
    assert index.hash_block_size == HBS


# ---- N14: shared tiers by store ---------------------------------------------------------------
def test_stores_sharing_a_name_are_separate_pools_and_weights_follow_the_name() -> None:
    prompt = prompt_of(9)
    here = medium_name("disk", "disk", {"path": "/srv/cache"}, this_host="h1")
    there = medium_name("disk", "disk", {"path": "/srv/cache"}, this_host="h2")  # another host's disk
    assert here != there and here.startswith("disk@")
    index = CacheIndex(hash_block_size=HBS)
    index.apply("a", [tier(prompt, e, here, locality="REMOTE") for e in range(16, 81, 16)])
    index.apply("b", [Removed((1,), there, None, "REMOTE", None)])  # b reads its own disk
    index.apply("c", [Removed((1,), here, None, "REMOTE", None)])  # c reads a's
    assert index.restorable("b", prompt) == {there: 0}
    assert index.restorable("c", prompt) == {here: 80}
    index.apply("g", [gpu(prompt, 4)])  # GPU 64
    assert index.route(prompt, ["g", "c"]) == "c"  # 80 * 0.9 = 72
    assert index.route(prompt, ["c", "g"], weights={"disk": 0.5}) == "g"  # the tier's name weighs its media
    assert index.route(prompt, ["g", "c"], weights={"disk": 0.5, here: 1.0}) == "c"  # the medium's own first


def test_a_store_is_named_by_where_it_is_never_by_a_credential() -> None:
    redis = {"url": "redis://cache.internal:6379/0", "prefix": "hop", "password_file": "/run/secret/a"}
    same = {"url": "redis://cache.internal/0?", "prefix": "hop", "password_file": "/other/file"}
    assert medium_name("redis", "redis", redis) == medium_name("redis", "redis", same)
    assert medium_name("redis", "redis", redis) != medium_name("redis", "redis", {**redis, "prefix": "b"})
    assert medium_name("redis", "redis", redis) != medium_name(
        "redis", "redis", {**redis, "url": "redis://cache.internal:6379/1"})  # fmt: skip
    local = {"url": "redis://user@127.0.0.1:6379/0?password=x&db=2", "prefix": "hop"}
    assert medium_name("r", "redis", local, "h1") != medium_name("r", "redis", local, "h2")  # loopback
    assert store_location("redis", local, "h1")["url"] == "redis://user@127.0.0.1:6379/0?[('db', '2')]@h1"
    peers = {"peers": ["b:7000", "a:7000"], "token_file": "/t"}
    ordered = {"peers": ["a:7000", "b:7000"]}
    assert medium_name("p", "nixl_peer", peers) == medium_name("p", "nixl_peer", ordered)
    options = {"url": "s3://key:sekrit@bucket/x", "api_token": "t", "n": 1}
    custom = store_location("pkg.mod:Store", options, "h")
    assert "sekrit" not in str(custom) and "api_token" not in str(custom) and custom["options"]["n"] == 1
