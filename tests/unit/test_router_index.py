"""The router's CacheIndex: restorable prefixes of hybrid models (attention coverage and a state
at its end), per engine and medium, pooled for shared tiers, vLLM's GPU cache cleared alone, the
hash block size learned, routing by weighted restorable tokens."""

from __future__ import annotations

import dataclasses
import random

import pytest

from hybrid_offload.router import CacheIndex, Cleared, Removed, Stored, block_hashes, external

HBS = 16
ATTN, STATE, WINDOW = 0, 1, 2
KINDS = {ATTN: "full_attention", STATE: "mamba", WINDOW: "sliding_window"}


def chain(tokens: list[int], as_int: bool = True) -> list:
    return [external(h, as_int) for h in block_hashes(tokens, HBS)]


def stored(tokens: list[int], end: int, group: int, medium: str = "cpu", span: int = HBS,
           locality: str | None = "LOCAL", window: int | None = None, as_int: bool = True,
           kind: str | None = "") -> Stored:  # fmt: skip
    """Our event: the block of ``span`` tokens of ``tokens`` ending at ``end`` (the contract)."""
    hashes = chain(tokens, as_int)
    parent = hashes[(end - span) // HBS - 1] if end > span else None
    return Stored((hashes[end // HBS - 1],), parent, tuple(tokens[end - span : end]), span, medium, group,
                  KINDS[group] if kind == "" else kind, window, locality, "hybrid-offload")  # fmt: skip


def removed(tokens: list[int], end: int, group: int | None, medium: str = "cpu",
            locality: str | None = "LOCAL") -> Removed:  # fmt: skip
    return Removed((chain(tokens)[end // HBS - 1],), medium, group, locality, "hybrid-offload")


def gpu(tokens: list[int], blocks: int, group: int, kind: str | None = None) -> Stored:
    """vLLM's own GPU event: ``blocks`` blocks of HBS tokens from the start, one hash each."""
    hashes = chain(tokens)[:blocks]
    tokens = tokens[: blocks * HBS]
    return Stored(tuple(hashes), None, tuple(tokens), HBS, "GPU", group, kind, None, None, None)


@pytest.fixture
def prompt() -> list[int]:
    rng = random.Random(1)
    return [rng.randrange(3, 2048) for _ in range(HBS * 8 + 5)]  # 8 hash blocks and a partial tail


def test_a_hybrid_prefix_needs_attention_up_to_a_state(prompt) -> None:
    index = CacheIndex(hash_block_size=HBS)
    index.apply("a", [stored(prompt, e, ATTN) for e in range(16, 81, 16)])  # attention: 5 chunks
    assert index.restorable("a", prompt) == {"cpu": 80}  # no state group known yet: attention only
    index.apply("a", [stored(prompt, 112, STATE)])
    assert index.restorable("a", prompt) == {"cpu": 0}  # no state within the attention's 80 tokens
    index.apply("a", [stored(prompt, 48, STATE)])
    assert index.restorable("a", prompt) == {"cpu": 48}  # a state at chunk 3: 3 chunks
    index.apply("a", [stored(prompt, e, ATTN) for e in (112, 128)])
    assert index.restorable("a", prompt) == {"cpu": 48}  # 96 is missing: 112 does not count
    index.apply("a", [stored(prompt, 96, ATTN)])
    assert index.restorable("a", prompt) == {"cpu": 112}
    assert index.restorable("a", prompt[:128]) == {"cpu": 112}  # never all of it: the last token runs
    assert index.restorable("a", prompt[:113]) == {"cpu": 112}
    assert index.restorable("a", prompt[:112]) == {"cpu": 48}
    assert index.restorable("a", prompt[:47]) == {"cpu": 0}  # the partial tail has no hash
    other = [t + 1 for t in prompt]
    assert index.restorable("a", other) == {"cpu": 0}  # another prompt shares no hash
    assert index.restorable("b", prompt) == {}  # another engine holds nothing
    index.apply("a", [removed(prompt, 112, STATE)])
    assert index.restorable("a", prompt) == {"cpu": 48}
    index.apply("a", [removed(prompt, 16, ATTN)])
    assert index.restorable("a", prompt) == {"cpu": 0}


def test_attention_without_any_state_restores_nothing_of_a_hybrid(prompt) -> None:
    index = CacheIndex(hash_block_size=HBS)
    index.apply("a", [gpu(prompt, 8, ATTN, "full_attention"), gpu(prompt, 1, STATE, "mamba")])
    index.apply("a", [stored(prompt, e, ATTN) for e in range(16, 129, 16)])  # the cpu tier: no state
    assert index.restorable("a", prompt) == {"GPU": 16, "cpu": 0}


@pytest.mark.parametrize("window_kind", ["sliding_window", "sliding_window_mla"])
def test_spans_of_several_hash_blocks_and_a_sliding_window(window_kind) -> None:
    rng = random.Random(2)
    prompt = [rng.randrange(3, 2048) for _ in range(HBS * 24 + 7)]
    span = 4 * HBS  # a chunk of 64 tokens, hash blocks of 16: blocks name every 4th hash
    index = CacheIndex(hash_block_size=HBS)
    index.apply("a", [stored(prompt, e, ATTN, span=span) for e in (64, 128, 192, 256, 320)])
    index.apply("a", [stored(prompt, e, STATE, span=span) for e in (64, 192, 320)])
    ends = (128, 192, 256, 320)
    window = [stored(prompt, e, WINDOW, span=span, window=100, kind=window_kind) for e in ends]
    index.apply("a", window)
    # at 320 the window needs the blocks ending at 320 and 256 (tokens 220..320): held
    assert index.restorable("a", prompt) == {"cpu": 320}
    index.apply("a", [removed(prompt, 256, WINDOW)])
    # 192: blocks ending 192 and 128 (tokens 92..192) held; 64 needs the window's block ending 64
    assert index.restorable("a", prompt) == {"cpu": 192}
    index.apply("a", [removed(prompt, 192, STATE)])
    assert index.restorable("a", prompt) == {"cpu": 0}
    index.apply("a", [stored(prompt, 64, WINDOW, span=span, window=100, kind=window_kind)])
    assert index.restorable("a", prompt) == {"cpu": 64}
    # a hash of the span's inner positions is no block end: a state there is never used
    inner = chain(prompt)[10 - 1]  # the hash at 160
    index.apply("a", [Stored((inner,), None, (), span, "cpu", STATE, "mamba", None, "LOCAL", None)])
    assert index.restorable("a", prompt) == {"cpu": 64}


def test_shared_tiers_pool_across_engines_and_gpu_clears_alone(prompt) -> None:
    index = CacheIndex(hash_block_size=HBS)
    index.apply("a", [stored(prompt, e, ATTN, "redis", locality="REMOTE") for e in (16, 32, 48)])
    index.apply("a", [stored(prompt, 32, STATE, "redis", locality="REMOTE")])
    index.apply("a", [gpu(prompt, 4, ATTN), gpu(prompt, 1, STATE)])  # vLLM's GPU events: no kinds
    index.apply("a", [stored(prompt, 64, STATE), *[stored(prompt, e, ATTN) for e in (16, 32, 48, 64)]])
    assert index.restorable("a", prompt) == {"GPU": 16, "cpu": 64, "redis": 32}  # GPU: a state at 16 only
    assert index.restorable("b", prompt) == {}  # b never published redis: not attached
    index.apply("b", [removed(prompt, 128, ATTN, "redis", "REMOTE")])  # b reads redis too
    assert index.restorable("b", prompt) == {"redis": 32}  # b restores what a stored
    index.apply("c", [gpu(prompt, 8, ATTN, "full_attention"), gpu(prompt, 8, STATE, "mamba")])
    assert index.route(prompt, ["b", "a", "c"]) == "c"  # 112 GPU tokens beat a's 64 cpu ones
    assert index.best(prompt, ["b", "a"]) == [
        ("a", "cpu", 64), ("b", "redis", 32), ("a", "redis", 32), ("a", "GPU", 16)]  # fmt: skip
    index.apply("b", [removed(prompt, 32, STATE, "redis", "REMOTE")])  # b found it gone
    assert index.restorable("a", prompt)["redis"] == 0  # for everyone
    index.apply("a", [Cleared()])
    assert index.restorable("a", prompt) == {"cpu": 64, "redis": 0}  # its GPU only
    index.reset_engine("a")  # a restarted: its own media gone, the pool stays
    index.apply("b", [stored(prompt, 32, STATE, "redis", locality="REMOTE")])
    assert index.restorable("a", prompt) == {"redis": 32}
    index.apply("a", [removed(prompt, 48, None, "redis")])  # no locality: the name is pooled; every group
    assert index.restorable("b", prompt) == {"redis": 32}
    index.apply("b", [removed(prompt, 32, None, "redis", None)])
    assert index.restorable("b", prompt) == {"redis": 0}


def test_gpu_group_kinds_come_from_our_events(prompt) -> None:
    """vLLM's GPU events may carry no kind: a group is attention until an event names it."""
    index = CacheIndex(hash_block_size=HBS)
    index.apply("a", [gpu(prompt, 6, ATTN), gpu(prompt, 6, STATE)])
    index.apply("a", [Stored((chain(prompt)[1],), None, (), HBS, "GPU", STATE, None, None, None, None)])
    assert index.restorable("a", prompt) == {"GPU": 96}  # both groups counted as attention
    index.apply("a", [removed(prompt, 96, STATE, "GPU", None)])
    assert index.restorable("a", prompt) == {"GPU": 80}
    index.apply("a", [stored(prompt, 16, STATE)])  # ours: group 1 is mamba; states at 16, 32 .. 80
    index.apply("a", [removed(prompt, e, STATE, "GPU", None) for e in (48, 64, 80)])
    assert index.restorable("a", prompt) == {"GPU": 32, "cpu": 0}


def test_int_and_bytes_hashes_compare_alike(prompt) -> None:
    index = CacheIndex(hash_block_size=HBS)
    index.apply("a", [stored(prompt, e, ATTN, as_int=False) for e in (16, 32)])  # an engine publishing bytes
    index.apply("a", [stored(prompt, 32, STATE, as_int=False)])
    assert index.restorable("a", prompt) == {"cpu": 32}
    index.apply("a", [removed(prompt, 32, STATE)])  # the same block named by its int
    assert index.restorable("a", prompt) == {"cpu": 0}


def test_the_hash_block_size_is_learned(prompt) -> None:
    index = CacheIndex()
    index.apply("a", [stored(prompt, e, g, span=32) for e in (32, 64, 96) for g in (ATTN, STATE)])
    assert index.hash_block_size is None  # our tiers' events teach nothing: vLLM's GPU ones do
    assert index.restorable("a", prompt) == {"cpu": 0}
    index.apply("a", [stored(prompt, 64, ATTN, "GPU", span=32, locality=None)])
    assert index.hash_block_size is None  # nothing to learn from yet: no first block
    index.apply("a", [stored(prompt, 32, ATTN, "GPU", span=32, locality=None)])
    assert index.hash_block_size == HBS  # not 32: the hash at 32 chains two blocks of 16
    assert index.restorable("a", prompt) == {"GPU": 0, "cpu": 96}  # what came before counts now

    from_gpu = CacheIndex()  # vLLM's GPU event: several blocks of 32, one hash each
    h = chain(prompt)
    first_two = tuple(prompt[:64])
    from_gpu.apply("g", [Stored((h[1], h[3]), None, first_two, 32, "GPU", 0, None, None, None, None)])
    assert from_gpu.hash_block_size == HBS
    quirk = CacheIndex()  # vLLM's mamba align mode: ONE hash, at the end of two blocks' tokens
    quirk.apply("g", [Stored((h[3],), None, first_two, 32, None, 1, "mamba", None, None, None)])
    assert quirk.hash_block_size == HBS

    salted = CacheIndex()  # a first block hashed with extra keys (a LoRA) teaches nothing
    salted.apply("a", [dataclasses.replace(gpu(prompt, 1, ATTN), has_extra_keys=True)])
    assert salted.hash_block_size is None

    wrong = CacheIndex(seed="not the engine's")
    wrong.apply("a", [gpu(prompt, 2, ATTN)])
    assert wrong.hash_block_size is None and wrong.restorable("a", prompt) == {"GPU": 0}
    assert wrong.stats.learn_failures == 1


def test_memory_is_bounded_per_medium(prompt) -> None:
    index = CacheIndex(hash_block_size=HBS, max_blocks=4)
    index.apply("a", [stored(prompt, e, ATTN) for e in (16, 32, 48, 64)])
    index.apply("a", [stored(prompt, 16, ATTN)])  # used again: the newest
    index.apply("a", [stored(prompt, 80, ATTN)])  # evicts the oldest, 32
    assert index.restorable("a", prompt) == {"cpu": 16}
    index.apply("a", [stored(prompt, 32, ATTN)])  # evicts 48
    assert index.restorable("a", prompt) == {"cpu": 32}


def test_route_weights_gpu_over_tiers_and_breaks_ties(prompt) -> None:
    index = CacheIndex(hash_block_size=HBS)
    index.apply("a", [gpu(prompt, 4, ATTN, "full_attention")])  # GPU 64
    index.apply("b", [stored(prompt, e, ATTN) for e in (16, 32, 48, 64, 80)])  # cpu 80: 72 weighted
    assert index.route(prompt, ["a", "b"]) == "b"
    index.apply("b", [removed(prompt, 80, ATTN)])  # cpu 64: 57.6 weighted
    assert index.route(prompt, ["b", "a"]) == "a"
    assert index.route(prompt, ["a", "b"], weights={"cpu": 1.0}) == "a"  # equal: the first
    assert index.route(prompt, ["a", "b"], weights={"cpu": 1.0}, load={"a": 2, "b": 1}) == "b"
    cold = [1, 2, 3] * 40
    assert [index.route(cold, ["a", "b", "c"]) for _ in range(4)] == ["a", "b", "c", "a"]  # round robin
    assert index.route(cold, ["a", "b", "c"], load={"a": 1, "b": 0, "c": 0}) == "b"
    with pytest.raises(ValueError):
        index.route(prompt, [])
