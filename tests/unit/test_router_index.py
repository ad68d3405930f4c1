"""The router side of KV events (hybrid_offload/router): vLLM's hashes recomputed without vLLM,
real vLLM event batches decoded, and restorable prefixes of hybrid models (attention coverage
and a state at its end), per engine, per medium, pooled for shared tiers."""

from __future__ import annotations

import random

import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import sha256, sha256_cbor
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash

from hybrid_offload.core.kv_events import KVEventsSpec
from hybrid_offload.router import CacheIndex, Cleared, Removed, Stored, block_hashes, decode_batch
from hybrid_offload.router.events import MalformedBatchError
from hybrid_offload.router.hashing import HashAlgoError

HBS = 16
EXT = KVEventsSpec(HBS)


@pytest.mark.parametrize(("algo", "fn"), [("sha256", sha256), ("sha256_cbor", sha256_cbor)])
@pytest.mark.parametrize("size", [1, 16, 64])
def test_prompt_hashes_are_vllms(algo, fn, size) -> None:
    rng = random.Random(size)
    tokens = [rng.randrange(0, 150_000) for _ in range(rng.randrange(3 * size, 9 * size + 7))]
    init_none_hash(fn)
    want, parent = [], None
    for start in range(0, len(tokens) - size + 1, size):
        parent = hash_block_tokens(fn, parent, tokens[start : start + size])
        want.append(parent)
    assert block_hashes(tokens, size, algo) == want
    assert [EXT.external(h) for h in want] == [maybe_convert_block_hash(h) for h in want]
    assert block_hashes(tokens, size, algo, seed="7") != want


def test_unreproducible_algorithms_are_refused() -> None:
    with pytest.raises(HashAlgoError, match="xxhash"):
        CacheIndex(algo="xxhash")


def test_real_vllm_batches_decode() -> None:
    batch = KVEventBatch(ts=1.5, events=[
        BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=[1, 2, 3], block_size=16,
                    lora_id=None, medium="disk", lora_name=None, group_idx=2, kv_cache_spec_kind="mamba",
                    locality="REMOTE", ownership="hybrid-offload"),
        BlockRemoved(block_hashes=[b"\x01" * 32], medium="cpu", group_idx=1, locality="LOCAL"),
        AllBlocksCleared(),
    ], data_parallel_rank=0)
    ts, events = decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert ts == 1.5
    assert events == [
        Stored((7, 8), None, (1, 2, 3), 16, "disk", 2, "mamba", None, "REMOTE", "hybrid-offload"),
        Removed((b"\x01" * 32,), "cpu", 1, "LOCAL", None),
        Cleared(),
    ]
    for bad in (b"\xc1", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode([1.0, [3]])):
        with pytest.raises(MalformedBatchError):
            decode_batch(bad)


# ---- the index ----------------------------------------------------------------------------
ATTN, STATE, WINDOW = 0, 1, 2


def chain(tokens: list[int]) -> list[int]:
    return [EXT.external(h) for h in block_hashes(tokens, HBS)]


def stored(tokens: list[int], end: int, group: int, kind: str, medium: str = "cpu", span: int = HBS,
           locality: str = "LOCAL", window: int | None = None) -> Stored:
    """Our block of ``span`` tokens ending at ``end`` of ``tokens``."""
    hashes = chain(tokens)
    parent = hashes[(end - span) // HBS - 1] if end > span else None
    return Stored((hashes[end // HBS - 1],), parent, tuple(tokens[end - span : end]), span, medium, group,
                  kind, window, locality, "hybrid-offload")


def removed(tokens: list[int], end: int, group: int, medium: str = "cpu", locality: str = "LOCAL") -> Removed:
    return Removed((chain(tokens)[end // HBS - 1],), medium, group, locality, "hybrid-offload")


@pytest.fixture
def prompt() -> list[int]:
    rng = random.Random(1)
    return [rng.randrange(3, 2048) for _ in range(16 * 8 + 5)]  # 8 hash blocks and a partial one


def test_a_hybrid_prefix_needs_attention_up_to_a_state(prompt) -> None:
    index = CacheIndex(hash_block_size=HBS)
    index.apply("a", [stored(prompt, e, ATTN, "full_attention") for e in range(16, 81, 16)])
    index.apply("a", [stored(prompt, 112, STATE, "mamba")])
    assert index.restorable("a", prompt) == {"cpu": 0}  # no state within the attention's 80
    index.apply("a", [stored(prompt, 48, STATE, "mamba")])
    assert index.restorable("a", prompt) == {"cpu": 48}
    index.apply("a", [stored(prompt, e, ATTN, "full_attention") for e in (112, 128)])
    assert index.restorable("a", prompt) == {"cpu": 48}  # 96 is missing: 112 does not count
    index.apply("a", [stored(prompt, 96, ATTN, "full_attention")])
    assert index.restorable("a", prompt) == {"cpu": 112}
    assert index.restorable("a", prompt[:112]) == {"cpu": 48}  # never the whole prompt
    assert index.restorable("b", prompt) == {}  # another engine holds nothing
    index.apply("a", [removed(prompt, 48, STATE), removed(prompt, 16, ATTN)])
    assert index.restorable("a", prompt) == {"cpu": 0}


def test_spans_of_several_hash_blocks_and_a_sliding_window(prompt) -> None:
    index = CacheIndex(hash_block_size=HBS)
    index.apply("a", [stored(prompt, e, ATTN, "full_attention", span=32) for e in (32, 64, 96)])
    index.apply("a", [stored(prompt, e, STATE, "mamba", span=32) for e in (32, 96)])
    index.apply("a", [stored(prompt, e, WINDOW, "sliding_window", span=32, window=40) for e in (64, 96)])
    # at 96 the window needs the blocks ending at 96 and 64 (tokens 56..96): both held
    assert index.restorable("a", prompt) == {"cpu": 96}
    index.apply("a", [removed(prompt, 64, WINDOW)])
    assert index.restorable("a", prompt) == {"cpu": 0}  # 32: the window's block ending 32 is missing


def test_shared_tiers_pool_across_engines_and_gpu_clears_alone(prompt) -> None:
    index = CacheIndex(hash_block_size=HBS)
    shared = {"medium": "redis", "locality": "REMOTE"}
    index.apply("a", [stored(prompt, e, ATTN, "full_attention", **shared) for e in (16, 32)])
    index.apply("a", [stored(prompt, 32, STATE, "mamba", "redis", locality="REMOTE")])
    index.apply("b", [stored(prompt, 16, ATTN, "full_attention", "redis", locality="REMOTE")])
    index.apply("a", [stored(prompt, e, g, k, "GPU") for e in (16, 32, 48)
                      for g, k in ((ATTN, "full_attention"), (STATE, "mamba"))])
    assert index.restorable("a", prompt) == {"GPU": 48, "redis": 32}
    assert index.restorable("b", prompt) == {"redis": 32}  # b reads the pool a filled
    assert index.route(prompt, ["b", "a"]) == "a"
    index.apply("b", [removed(prompt, 32, STATE, "redis", "REMOTE")])  # b saw it gone
    assert index.restorable("a", prompt) == {"GPU": 48, "redis": 0}
    index.apply("a", [Cleared()])
    assert index.restorable("a", prompt) == {"redis": 0}
    assert index.route(prompt, ["a", "b"], load={"a": 3, "b": 1}) == "b"  # a tie: the idler one


def test_the_hash_block_size_is_learned_from_a_first_block(prompt) -> None:
    index = CacheIndex()
    assert index.restorable("a", prompt) == {}
    index.apply("a", [stored(prompt, 32, ATTN, "full_attention", span=32),
                      stored(prompt, 32, STATE, "mamba", span=32)])
    assert index.hash_block_size == HBS
    assert index.restorable("a", prompt) == {"cpu": 32}
    wrong = CacheIndex(seed="not the engine's")
    wrong.apply("a", [stored(prompt, 32, ATTN, "full_attention", span=32)])
    assert wrong.hash_block_size is None and wrong.restorable("a", prompt) == {}
