"""What the router (hybrid_offload/router) reproduces of vLLM without importing it: the block
hashes of a prompt (vLLM's own hasher on a real ``Request`` is the reference), and the wire
format of its KV events (real ``KVEventBatch`` objects encoded as vLLM's publisher does)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import msgspec
import pytest
from vllm import SamplingParams
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import sha256, sha256_cbor, xxhash
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from hybrid_offload.router import (
    Batch,
    CacheIndex,
    Cleared,
    MalformedBatchError,
    Removed,
    Stored,
    block_hashes,
    decode_batch,
    external,
)
from hybrid_offload.router.hashing import HashAlgoError, none_hash

ALGOS = {"sha256": sha256, "sha256_cbor": sha256_cbor, "xxhash": xxhash}


@pytest.fixture
def vllm_seed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vLLM's NONE_HASH is process-global: leave it as other tests expect (sha256, no seed)."""
    yield
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    init_none_hash(sha256)


def vllm_hashes(tokens: list[int], size: int, algo: str, **request_kw) -> list[bytes]:
    """vLLM's own: a real Request hashed by the engine's block hasher."""
    init_none_hash(ALGOS[algo])
    hasher = get_request_block_hasher(size, ALGOS[algo])
    request = Request("r", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher, **request_kw)
    return list(request.block_hashes)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("size", [1, 5, 16, 64])
def test_prompt_hashes_are_vllms(algo, size, vllm_seed, monkeypatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    rng = random.Random(size * 31 + len(algo))
    lengths = [0, size - 1, size, rng.randrange(2 * size + 1, 9 * size + 7)]  # tails not aligned
    for n in lengths:
        tokens = [rng.randrange(0, 200_000) for _ in range(n)]
        want = vllm_hashes(tokens, size, algo)
        got = block_hashes(tokens, size, algo)
        assert got == want and len(got) == n // size
        assert [external(h) for h in got] == [maybe_convert_block_hash(h) for h in want]
        assert [external(h, as_int=False) for h in got] == got
    assert none_hash(algo) == ALGOS[algo]("vllm-none-hash")


def test_a_seeded_engine_and_xxhash_with_its_seed(vllm_seed, monkeypatch) -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(0, 50_000) for _ in range(77)]
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    for algo in ("sha256", "xxhash"):
        want = vllm_hashes(tokens, 16, algo)
        assert block_hashes(tokens, 16, algo, seed="1234") == want
        assert block_hashes(tokens, 16, "sha256") != want  # the seed matters
    with pytest.raises(HashAlgoError, match="PYTHONHASHSEED"):
        block_hashes(tokens, 16, "xxhash")  # vLLM seeds it randomly per process
    with pytest.raises(HashAlgoError, match="PYTHONHASHSEED"):
        CacheIndex(algo="xxhash_cbor")
    with pytest.raises(HashAlgoError, match="unknown"):
        CacheIndex(algo="md5")


def test_requests_with_extra_keys_do_not_match(vllm_seed, monkeypatch) -> None:
    """A cache_salt (like LoRA or multimodal inputs) enters vLLM's hashes: documented misses."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = list(range(100, 164))
    assert block_hashes(tokens, 16) == vllm_hashes(tokens, 16, "sha256")
    salted = vllm_hashes(tokens, 16, "sha256", cache_salt="tenant-a")
    assert set(block_hashes(tokens, 16)).isdisjoint(salted)


def test_numpy_like_tokens_hash_as_ints() -> None:
    class Tok(int):  # an int subclass pickles differently from int (as numpy integers do)
        pass

    tokens = list(range(40))
    assert block_hashes([Tok(t) for t in tokens], 8) == block_hashes(tokens, 8)


# ---- the wire format -------------------------------------------------------------------------
def encode(*events, ts: float = 1.5, rank: int | None = 0) -> bytes:
    """Exactly as vLLM's ZmqEventPublisher: msgspec.msgpack.Encoder().encode(KVEventBatch)."""
    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=ts, events=list(events), data_parallel_rank=rank))


def test_real_vllm_batches_decode_with_every_field_we_read() -> None:
    digest = bytes(range(32))
    payload = encode(
        BlockStored(block_hashes=[7, 2**64 - 1], parent_block_hash=3, token_ids=[1, 2, 3, 4], block_size=2,
                    lora_id=None, medium="disk", lora_name=None, group_idx=2,
                    kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128,
                    locality="REMOTE", ownership="hybrid-offload"),
        BlockStored(block_hashes=[digest], parent_block_hash=None, token_ids=[9] * 16, block_size=16,
                    lora_id=None, medium=None, lora_name=None, extra_keys=[None]),  # GPU, bytes hashes
        BlockStored(block_hashes=[5], parent_block_hash=digest, token_ids=[1], block_size=1, lora_id=1,
                    medium="GPU", lora_name="sql", extra_keys=[("sql",)]),
        BlockStored(block_hashes=[6], parent_block_hash=None, token_ids=[1], block_size=1, lora_id=None,
                    medium="GPU", lora_name=None, extra_keys=[None, ("salt",)]),
        BlockRemoved(block_hashes=[digest, 8], medium="cpu", group_idx=1, locality="LOCAL"),
        BlockRemoved(block_hashes=[9], medium="GPU"),
        AllBlocksCleared(),
    )  # fmt: skip
    assert decode_batch(payload) == Batch(1.5, (
        Stored((7, 2**64 - 1), 3, (1, 2, 3, 4), 2, "disk", 2, "sliding_window", 128, "REMOTE",
               "hybrid-offload"),
        Stored((digest,), None, (9,) * 16, 16, None, None, None, None, None, None),
        Stored((5,), digest, (1,), 1, "GPU", None, None, None, None, None, has_extra_keys=True),
        Stored((6,), None, (1,), 1, "GPU", None, None, None, None, None, has_extra_keys=True),
        Removed((digest, 8), "cpu", 1, "LOCAL", None),
        Removed((9,), "GPU", None, None, None),
        Cleared(),
    ), 0)  # fmt: skip
    assert decode_batch(encode(ts=2, rank=None)) == Batch(2.0, (), None)


def test_unknown_event_types_are_skipped_and_fields_ignored() -> None:
    raw = msgspec.msgpack.decode(encode(BlockRemoved(block_hashes=[1], medium="cpu")))
    raw[1].insert(0, {"type": "BlockPinned", "block_hashes": [1]})  # a newer engine's event
    raw[1][1]["future_field"] = [1, 2]
    assert decode_batch(msgspec.msgpack.encode(raw)).events == (Removed((1,), "cpu", None, None, None),)


@pytest.mark.parametrize("payload", [
    b"\xc1",  # not msgpack
    msgspec.msgpack.encode({"ts": 1.0, "events": []}),  # a map, not vLLM's array
    msgspec.msgpack.encode([1.0]),
    msgspec.msgpack.encode([1.0, [3]]),  # an event that is no map
    msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]),  # untagged
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": ["x"]}]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": 5}]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": "16"}]]),
    msgspec.msgpack.encode(["now", []]),
    msgspec.msgpack.encode([1.0, [], 0, "extra"]),
])  # fmt: skip
def test_malformed_payloads_raise(payload: bytes) -> None:
    with pytest.raises(MalformedBatchError):
        decode_batch(payload)
