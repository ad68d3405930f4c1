"""HybridOffloadPlanner: default chunk, validation, keys, coverage and the loadable prefix.

The property tests compare ``loadable_prefix`` (and ``lookup``) against a brute-force reference
written from the coverage rules stated in token terms, not from the planner's own helpers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import struct
import subprocess
import sys
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_offload.backends.base import KEY_PATTERN, check_keys
from hybrid_offload.core.planner import (
    DEFAULT_MIN_CHUNK_TOKENS,
    HybridOffloadPlanner,
    LoadablePrefix,
    PlannerConfigError,
    chain_chunk_hashes,
    default_chunk_tokens,
)
from hybrid_offload.core.spec import GroupKind, GroupSpec, ModelSpec, make_model_spec

MODEL_FIELDS = {"name": "test/hybrid-tiny", "revision": None, "dtype": "bfloat16"}
PROPERTY_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---- hand-built specs ------------------------------------------------------------------------
def fa(index: int, block: int = 16, layers: int = 2) -> GroupSpec:
    return GroupSpec(
        index=index, kind=GroupKind.FULL_ATTENTION, block_size=block,
        layer_names=tuple(f"model.layers.{index}.{i}.attn" for i in range(layers)),
        page_bytes=block * 2 * 64 * 2 * 2, num_kv_heads=2, head_size=64, head_size_v=64,
    )


def sw(index: int, block: int = 16, window: int = 128, layers: int = 2) -> GroupSpec:
    return GroupSpec(
        index=index, kind=GroupKind.SLIDING_WINDOW, block_size=block,
        layer_names=tuple(f"model.layers.{index}.{i}.swa" for i in range(layers)),
        page_bytes=block * 2 * 64 * 2 * 2, num_kv_heads=2, head_size=64, head_size_v=64,
        sliding_window=window,
    )


def mamba(index: int, block: int = 128, mode: str = "align", layers: int = 2) -> GroupSpec:
    return GroupSpec(
        index=index, kind=GroupKind.MAMBA, block_size=block,
        layer_names=tuple(f"model.layers.{index}.{i}.mixer" for i in range(layers)),
        page_bytes=65536, dtype="bfloat16",
        state_shapes=((3, 288), (4, 64, 16)), state_dtypes=("bfloat16", "float32"),
        mamba_cache_mode=mode, mamba_type="MAMBA2",
    )


def model(*groups: GroupSpec, fields: dict | None = None, **kw: int) -> ModelSpec:
    return make_model_spec(tuple(groups), dict(fields or MODEL_FIELDS), **kw)


def planner(*groups: GroupSpec, chunk: int | None = None, **kw: int) -> HybridOffloadPlanner:
    return HybridOffloadPlanner(model(*groups, **kw), chunk)


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 104729) % 151_936 for i in range(n)]


# ---- default chunk ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        ((fa(0, 128), mamba(1, 128)), 128),
        # qwen3-next-like: vLLM raises the attention block to the GDN page size; states are
        # checkpointed at a finer granularity inside it
        ((fa(0, 640), mamba(1, 640)), 128),
        ((fa(0, 256), mamba(1, 256)), 128),
        ((fa(0, 16), mamba(1, 64)), 16),  # a divisor of every block: a resume point in each
        ((fa(0, 48), mamba(1, 32)), 16),
        ((fa(0, 16), sw(1, 16), mamba(2, 128)), 16),
        ((fa(0, 544), mamba(1, 544)), 32),
        ((fa(0, 16),), 256),
        ((fa(0, 16), sw(1, 32)), 256),
        ((fa(0, 96),), 288),  # lcm 96 rounded up to a multiple >= 256
        ((fa(0, 48), sw(1, 80)), 480),  # lcm 240 -> 480
        ((fa(0, 512),), 512),
        ((fa(0, 1024), sw(1, 16)), 1024),
    ],
)
def test_default_chunk(groups: tuple[GroupSpec, ...], expected: int) -> None:
    assert default_chunk_tokens(groups) == expected
    p = HybridOffloadPlanner(model(*groups))
    assert p.chunk_tokens == expected
    for g in groups:  # the default is always valid for every group
        assert expected % g.block_size == 0 or g.block_size % expected == 0


@pytest.mark.parametrize("mode", ["none", None, "all"])
def test_default_chunk_ignores_unsplittable_mamba_blocks(mode: str | None) -> None:
    # Its block (one per request, max_model_len tokens) must not enter the chunk, and a model
    # whose only Mamba group is unsplittable still resumes at the hybrid granularity (prefix
    # caching off: the chunk is where a chat's next turn can resume).
    assert default_chunk_tokens((fa(0, 128), mamba(1, 40_000, mode))) == 128
    assert default_chunk_tokens((fa(0, 640), mamba(1, 40_000, mode))) == 128
    assert default_chunk_tokens((fa(0, 256), mamba(1, 40_000, mode))) == 128
    assert default_chunk_tokens((fa(0, 96), mamba(1, 40_000, mode))) == 32
    assert default_chunk_tokens((fa(0, 128), mamba(1, 40_000, mode), mamba(2, 64))) == 64
    assert default_chunk_tokens((mamba(0, 40_000, mode),)) == 128
    p = planner(fa(0, 64), mamba(1, 40_000, mode))
    assert p.plans[1].unsplittable
    assert p.mamba_state_block_index(p.plans[1], 3 * p.chunk_tokens) == 0


def test_default_chunk_no_groups() -> None:
    assert default_chunk_tokens(()) == DEFAULT_MIN_CHUNK_TOKENS


# ---- validation ------------------------------------------------------------------------------
def test_block_dividing_chunk() -> None:
    p = planner(fa(0, 16), sw(1, 32), mamba(2, 64), chunk=128)
    ratios = [(pl.blocks_per_chunk, pl.chunks_per_block) for pl in p.plans]
    assert ratios == [(8, 1), (4, 1), (2, 1)]
    assert not any(pl.unsplittable for pl in p.plans)


def test_block_split_into_chunks() -> None:
    p = planner(fa(0, 512), mamba(1, 512), sw(2, 256, window=300), chunk=128)
    ratios = [(pl.blocks_per_chunk, pl.chunks_per_block) for pl in p.plans]
    assert ratios == [(1, 4), (1, 4), (1, 2)]
    assert p.plans[2].window_chunks == 3  # 299 tokens before N -> 3 chunks of 128
    # the state at N lives in the block covering token N - 1, also inside a block
    assert p.mamba_state_block_index(p.plans[1], 1024) == 1
    assert p.mamba_state_block_index(p.plans[1], 512) == 0
    assert p.mamba_state_block_index(p.plans[1], 640) == 1
    assert p.mamba_state_block_index(p.plans[1], 128) == 0


@pytest.mark.parametrize(
    ("groups", "chunk", "bad_index", "block"),
    [
        ((fa(0, 16),), 40, 0, 16),  # block < chunk, does not divide
        ((fa(0, 16), sw(1, 48)), 64, 1, 48),
        ((fa(0, 16), mamba(1, 128)), 96, 1, 128),  # block > chunk, not a multiple
        ((fa(0, 640), mamba(1, 640)), 256, 0, 640),
        ((sw(0, 16), fa(1, 100)), 64, 1, 100),
    ],
)
def test_incompatible_chunk_names_group_and_sizes(
    groups: tuple[GroupSpec, ...], chunk: int, bad_index: int, block: int
) -> None:
    with pytest.raises(PlannerConfigError) as info:
        HybridOffloadPlanner(model(*groups), chunk)
    message = str(info.value)
    assert f"group {bad_index}" in message
    assert str(chunk) in message and str(block) in message
    assert groups[bad_index].kind.value in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("chunk", [0, -1, -256])
def test_non_positive_chunk(chunk: int) -> None:
    with pytest.raises(PlannerConfigError, match="chunk_tokens"):
        planner(fa(0, 16), chunk=chunk)


def test_unsplittable_mamba_accepts_any_chunk() -> None:
    p = planner(fa(0, 16), mamba(1, 40_003, "none"), chunk=48)
    assert p.plans[1].unsplittable


def test_sliding_window_chunks() -> None:
    def window_chunks(window: int, chunk: int) -> int | None:
        return planner(sw(0, 16, window=window), chunk=chunk).plans[0].window_chunks

    # vLLM keeps the last window - 1 tokens before the next position
    assert window_chunks(128, 128) == 1
    assert window_chunks(129, 128) == 1
    assert window_chunks(130, 128) == 2
    assert window_chunks(4096, 256) == 16
    assert window_chunks(4097, 256) == 16
    assert window_chunks(4098, 256) == 17
    assert window_chunks(2, 64) == 1


# ---- keys ------------------------------------------------------------------------------------
def test_chunk_hashes_match_reference() -> None:
    """sha256 chains (issue 14 M4: no fast non-cryptographic hash anyone can collide)."""
    p = planner(fa(0, 16), mamba(1, 64), chunk=64)
    toks = tokens(64 * 3 + 17)
    hashes = p.chunk_hashes(toks, b"lora:a")
    assert len(hashes) == 3  # the partial chunk has no hash
    prev = hashlib.sha256(p.spec.fingerprint_bytes + b"\x00" + b"lora:a").digest()
    for i, h in enumerate(hashes):
        prev = hashlib.sha256(prev + struct.pack("<64q", *toks[i * 64 : (i + 1) * 64])).digest()
        assert h == prev and len(h) == 32
    assert chain_chunk_hashes(b"seed", toks, 64) == chain_chunk_hashes(b"seed", tuple(toks), 64)
    assert chain_chunk_hashes(b"seed", toks[:63], 64) == []
    assert p.chunk_hashes([]) == []


def test_keyed_chunk_hashes_are_hmac_sha256() -> None:
    """With the cache's secret, chains are HMAC-SHA256 under it: keys of the same prompt differ
    per secret, and nobody without it can compute them (issue 14 M4)."""
    spec = planner(fa(0, 16), chunk=64).spec
    secret = b"s3cret-key"
    keyed = HybridOffloadPlanner(spec, 64, secret)
    toks = tokens(64 * 2)
    prev = hmac.digest(secret, spec.fingerprint_bytes + b"\x00", "sha256")
    want = []
    for i in range(2):
        prev = hmac.digest(secret, prev + struct.pack("<64q", *toks[i * 64 : (i + 1) * 64]), "sha256")
        want.append(prev)
    assert keyed.chunk_hashes(toks) == want
    plain, other = HybridOffloadPlanner(spec, 64), HybridOffloadPlanner(spec, 64, b"other")
    keys = [q.group_keys(q.chunk_hashes(toks)) for q in (keyed, plain, other)]
    assert len({json.dumps(k) for k in keys}) == 3


def test_large_token_ids_are_not_truncated() -> None:
    p = planner(fa(0, 16), chunk=16)
    a = [1] * 16
    b = [1 + (1 << 32)] * 16
    assert p.chunk_hashes(a) != p.chunk_hashes(b)


_SUBPROCESS_KEYS = """
import json, sys
from hybrid_offload.core.spec import GroupKind, GroupSpec, make_model_spec
from hybrid_offload.core.planner import HybridOffloadPlanner
args = json.loads(sys.argv[1])
groups = tuple(GroupSpec.from_dict(g) for g in args["groups"])
p = HybridOffloadPlanner(make_model_spec(groups, args["fields"]), 128)
hashes = p.chunk_hashes(args["tokens"], b"salt")
keys = p.group_keys(hashes)
shards = [[p.piece_keys(k, g) for k in ks] for g, ks in enumerate(keys)]
print(json.dumps({"fp": p.spec.fingerprint, "keys": keys, "shards": shards}))
"""


def test_keys_deterministic_across_processes_and_hash_seeds() -> None:
    groups = (dataclasses.replace(fa(0, 16), shards=2), sw(1, 32, window=100), mamba(2, 128))
    toks = tokens(128 * 5 + 3)
    p = planner(*groups, chunk=128)
    keys = p.group_keys(p.chunk_hashes(toks, b"salt"))
    shards = [[p.piece_keys(k, g) for k in ks] for g, ks in enumerate(keys)]
    here = {"fp": p.spec.fingerprint, "keys": keys, "shards": shards}
    assert len(here["keys"]) == 3 and all(len(k) == 5 for k in here["keys"])
    assert [len(s[0]) for s in shards] == [2, 1, 1]
    args = json.dumps({"groups": [dataclasses.asdict(g) for g in groups],
                       "fields": MODEL_FIELDS, "tokens": toks})
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS_KEYS, args],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == here


def test_keys_chained() -> None:
    p = planner(fa(0, 16), mamba(1, 64), chunk=64)
    base = tokens(64 * 6)
    base_keys = p.group_keys(p.chunk_hashes(base))
    for i in range(6):
        for pos in (i * 64, i * 64 + 31, i * 64 + 63):
            changed = list(base)
            changed[pos] += 1
            keys = p.group_keys(p.chunk_hashes(changed))
            for g in range(2):
                assert keys[g][:i] == base_keys[g][:i]
                assert all(a != b for a, b in zip(keys[g][i:], base_keys[g][i:], strict=True))
    # tokens after the last full chunk do not matter
    assert p.group_keys(p.chunk_hashes([*base, 5, 6, 7])) == base_keys


def test_keys_scoped_by_fingerprint_scope_group_and_shard() -> None:
    toks = tokens(64 * 4)
    groups = (dataclasses.replace(fa(0, 16), shards=2), mamba(1, 64))
    a = planner(*groups, chunk=64)
    other = model(*groups, fields={**MODEL_FIELDS, "name": "x"})
    b = HybridOffloadPlanner(other, 64)
    assert a.namespace != b.namespace
    all_keys: list[str] = []
    for p in (a, b):
        for scope in (b"", b"lora:adapter-1", b"salt:abc", b"lora:adapter-2"):
            keys = p.group_keys(p.chunk_hashes(toks, scope))
            assert len(keys) == 2 and all(len(k) == 4 for k in keys)
            for g, group_keys in enumerate(keys):
                shard_keys = [s for k in group_keys for s in p.piece_keys(k, g)]
                for key in [*group_keys, *shard_keys]:
                    assert key.startswith(p.namespace + "-")
                    assert KEY_PATTERN.fullmatch(key), key
                check_keys(group_keys)
                all_keys.extend({*group_keys, *shard_keys})
    # 2 fingerprints x 4 scopes x (attention: 4 set keys + 8 shard keys; Mamba: 4 set + 4 piece keys)
    assert len(set(all_keys)) == len(all_keys) == 2 * 4 * (4 + 8 + 4 + 4)


def test_page_key_tail() -> None:
    p = planner(fa(0, 16), chunk=16)
    h = bytes(range(16))
    keys = {p.page_key(h, g) for g in (0, 1, 255, 256, 65535)}
    assert len(keys) == 5
    assert p.page_key(h, 3) == p.page_key(h, 3)


def test_keys_do_not_depend_on_tp_rank_or_size() -> None:
    """Engines at every TP size share one namespace and key every page set alike."""
    def group(heads: int) -> GroupSpec:
        return dataclasses.replace(fa(0, 16), num_kv_heads=heads, total_kv_heads=4)

    toks = tokens(128)
    made = [planner(group(4), chunk=64, max_shards=8),
            planner(group(2), chunk=64, tp_size=2, tp_rank=0, max_shards=8),
            planner(group(2), chunk=64, tp_size=2, tp_rank=1, max_shards=8),
            planner(group(1), chunk=64, tp_size=4, tp_rank=3, max_shards=8)]
    assert {p.spec.groups[0].shards for p in made} == {4}
    assert len({p.namespace for p in made}) == 1
    assert len({str(p.group_keys(p.chunk_hashes(toks))) for p in made}) == 1


def test_sets_contain_needs_every_shard() -> None:
    p = planner(dataclasses.replace(fa(0, 16), shards=2), mamba(1, 64), chunk=64)
    keys = p.group_keys(p.chunk_hashes(tokens(128)))
    stored = {*p.piece_keys(keys[0][0], 0), p.piece_keys(keys[0][1], 0)[1], *p.piece_keys(keys[1][0], 1),
              *p.piece_keys(keys[1][1], 1)}  # fmt: skip
    asked: list[list[str]] = []

    def contains(batch: list[str]) -> list[bool]:
        asked.append(batch)
        return [k in stored for k in batch]

    sets = p.sets_contain(keys, contains)
    assert sets([keys[0][0], keys[0][1], keys[1][0], keys[1][1]]) == [True, False, True, True]
    assert len(asked) == 1 and len(asked[0]) == 6  # one backend call for all shards
    assert sets([]) == []


# ---- coverage: explicit cases ----------------------------------------------------------------
C = 128


def hybrid() -> HybridOffloadPlanner:
    """FA + sliding window 256 (2 chunks) + Mamba align, all block 128, chunk 128."""
    return planner(fa(0, C), sw(1, C, window=256), mamba(2, C), chunk=C)


def present(n: int, missing: Sequence[int] = ()) -> list[bool]:
    return [i not in missing for i in range(n)]


def test_all_present_stops_below_prompt_end() -> None:
    p = hybrid()
    full = [present(10)] * 3
    assert p.loadable_prefix(full, 1000).tokens == 7 * C
    assert p.loadable_prefix(full, 8 * C).tokens == 7 * C  # never k chunks for k * chunk tokens
    assert p.loadable_prefix(full, 8 * C + 1).tokens == 8 * C
    assert p.loadable_prefix(full, C + 1).tokens == C
    assert p.loadable_prefix(full, C).tokens == 0
    for n in (0, 1, 2, C - 1):
        assert p.loadable_prefix(full, n) == LoadablePrefix(0, (0, 0, 0))
    assert p.max_boundary_chunks(8 * C) == 7
    assert p.max_boundary_chunks(0) == 0


def test_full_attention_needs_every_chunk() -> None:
    p = planner(fa(0, C), mamba(1, C), chunk=C)
    for hole in range(8):
        r = p.loadable_prefix([present(10, [hole]), present(10)], 10 * C)
        assert r.tokens == hole * C
    assert p.loadable_prefix([present(10, [0]), present(10)], 10 * C).tokens == 0


def test_sliding_window_needs_only_window_chunks() -> None:
    p = planner(sw(0, C, window=256), mamba(1, C), chunk=C)
    sparse = [i in (5, 6) for i in range(10)]
    assert p.loadable_prefix([sparse, present(10)], 1000).tokens == 7 * C
    sparse = [i == 6 for i in range(10)]  # window chunk 5 missing
    assert p.loadable_prefix([sparse, present(10)], 1000).tokens == 0
    # a window of 257 tokens needs 256 tokens before N: still 2 chunks; 258 needs 3
    p3 = planner(sw(0, C, window=258), mamba(1, C), chunk=C)
    assert p3.loadable_prefix([[i in (5, 6) for i in range(10)], present(10)], 1000).tokens == 0
    window3 = [i in (4, 5, 6) for i in range(10)]
    assert p3.loadable_prefix([window3, present(10)], 1000).tokens == 7 * C


def test_mamba_needs_only_the_state_at_n() -> None:
    p = hybrid()
    only3 = [i == 2 for i in range(10)]
    r = p.loadable_prefix([present(10), present(10), only3], 1000)
    assert r.tokens == 3 * C
    assert r.per_group_tokens == (7 * C, 7 * C, 3 * C)
    assert r.groups_disagree
    none = [False] * 10
    r = p.loadable_prefix([present(10), present(10), none], 1000)
    assert r.tokens == 0 and r.groups_disagree


def test_mamba_state_inside_a_block() -> None:
    # Mamba block 256 with chunk 128: a state resumes at any chunk boundary, inside blocks too
    p = planner(fa(0, C), mamba(1, 2 * C), chunk=C)
    full = [present(10), present(10)]
    assert p.loadable_prefix(full, 1000).tokens == 7 * C
    assert p.loadable_prefix(full, 6 * C + 1).tokens == 6 * C
    assert p.loadable_prefix(full, 6 * C).tokens == 5 * C
    assert p.loadable_prefix(full, 2 * C).tokens == C
    odd = [i in (2, 4) for i in range(10)]  # states at k=3 and k=5 only
    assert p.loadable_prefix([present(10), odd], 1000).tokens == 5 * C
    assert p.loadable_prefix([present(10), odd], 1000).attention_tokens == 7 * C


def test_unsplittable_mamba_any_boundary() -> None:
    p = planner(fa(0, C), mamba(1, 40_000, "none"), chunk=C)
    assert p.loadable_prefix([present(10), [i == 4 for i in range(10)]], 1000).tokens == 5 * C


def test_start_tokens() -> None:
    p = planner(fa(0, C), mamba(1, C), chunk=C)
    holes = [present(10, [0, 1]), present(10)]
    assert p.loadable_prefix(holes, 1000).tokens == 0
    assert p.loadable_prefix(holes, 1000, start_tokens=2 * C).tokens == 7 * C
    # vLLM's local hit need not be chunk-aligned: chunk 2 holds tokens 256..383
    assert p.loadable_prefix(holes, 1000, start_tokens=2 * C + 44).tokens == 7 * C
    assert p.loadable_prefix(holes, 1000, start_tokens=2 * C - 1).tokens == 0  # needs chunk 1
    # nothing beyond the local hit
    assert p.loadable_prefix(holes, 1000, start_tokens=7 * C).tokens == 0
    assert p.loadable_prefix(holes, 1000, start_tokens=7 * C - 1).tokens == 7 * C
    assert p.loadable_prefix(holes, 1000, start_tokens=5000) == LoadablePrefix(0, (0, 0))
    # the result is always beyond start_tokens
    for start in range(0, 1000, 37):
        r = p.loadable_prefix([present(10), present(10)], 1000, start_tokens=start)
        assert r.tokens == 0 or start < r.tokens < 1000


def test_sliding_window_window_clipped_by_start() -> None:
    p = planner(sw(0, C, window=4 * C), mamba(1, C), chunk=C)
    pres = [present(10, [0, 1, 2, 3]), present(10)]
    assert p.loadable_prefix(pres, 6 * C + 1, start_tokens=0).tokens == 0
    # N=6 chunks needs chunks 2..5 of the window; from start 4 only 4..5 are needed
    assert p.loadable_prefix(pres, 6 * C + 1, start_tokens=4 * C).tokens == 6 * C


def test_presence_shorter_than_prompt() -> None:
    p = hybrid()
    r = p.loadable_prefix([present(3), present(5), present(4)], 10_000)
    assert r.tokens == 3 * C
    assert r.per_group_tokens == (3 * C, 3 * C, 3 * C)
    assert p.loadable_prefix([[], [], []], 10_000) == LoadablePrefix(0, (0, 0, 0))


def test_groups_disagree_flag() -> None:
    p = hybrid()
    full = [present(10)] * 3
    assert not p.loadable_prefix(full, 1000).groups_disagree
    r = p.loadable_prefix([present(10, [4]), present(10), present(10)], 1000)
    assert r.tokens == 4 * C and r.per_group_tokens == (4 * C, 7 * C, 7 * C)
    assert r.groups_disagree


@pytest.mark.parametrize("prompt_len", [-5, 0, 1, 127, 128, 129, 10**9])
@pytest.mark.parametrize("start_tokens", [0, 1, 128, 10**9])
def test_never_raises_on_odd_inputs(prompt_len: int, start_tokens: int) -> None:
    p = hybrid()
    for pres in ([[], [], []], [present(4)] * 3, [[True], [False], [True]]):
        r = p.loadable_prefix(pres, prompt_len, start_tokens)
        assert r.tokens % C == 0 and r.tokens >= 0
        assert r.tokens == 0 or start_tokens < r.tokens < prompt_len
        r2 = p.lookup([["00000000-00000000"] * len(g) for g in pres],
                      lambda keys: [True] * len(keys), prompt_len, start_tokens)
        assert r2.tokens % C == 0


def test_lookup_asks_once() -> None:
    p = hybrid()
    keys = p.group_keys(p.chunk_hashes(tokens(10 * C)))
    calls: list[list[str]] = []

    def contains(batch: list[str]) -> list[bool]:
        calls.append(list(batch))
        return [k != keys[0][5] for k in batch]

    r = p.lookup(keys, contains, 1000, start_tokens=C)
    assert r.tokens == 5 * C
    assert len(calls) == 1
    # asks for chunks [start, k_max) of every group, nothing before the local hit
    assert sorted(calls[0]) == sorted(k for g in keys for k in g[1:7])
    calls.clear()
    assert p.lookup(keys, contains, C).tokens == 0
    assert calls == []  # nothing to ask for


# ---- property tests against a brute-force reference -----------------------------------------
def reference_allows(
    g: GroupSpec, chunk: int, pres: Sequence[bool], k: int, start_tokens: int
) -> bool:
    """Whether group ``g`` alone can be restored to N = k * chunk tokens, stated in tokens."""
    n = k * chunk

    def chunks_covering(lo: int, hi: int) -> range:
        """Chunks that hold any token in [lo, hi)."""
        return range(lo // chunk, (hi - 1) // chunk + 1) if lo < hi else range(0)

    if g.kind is GroupKind.FULL_ATTENTION:  # every token vLLM does not already have
        return all(pres[c] for c in chunks_covering(start_tokens, n))
    if g.kind is GroupKind.SLIDING_WINDOW:  # the window - 1 tokens before position N
        assert g.sliding_window is not None
        lo = max(start_tokens, n - (g.sliding_window - 1))
        return all(pres[c] for c in chunks_covering(lo, n))
    return pres[k - 1]  # the state after chunk k-1, i.e. at N (in the block holding token N-1)


def reference(
    groups: Sequence[GroupSpec], chunk: int, presence: Sequence[Sequence[bool]],
    prompt_len: int, start_tokens: int,
) -> tuple[int, tuple[int, ...]]:
    """Largest N = k * chunk with start_tokens < N < prompt_len that every group can restore,
    and per group the largest N that group alone allows."""
    n_chunks = min((len(p) for p in presence), default=0)

    def ok(g: GroupSpec, k: int) -> bool:
        return reference_allows(g, chunk, presence[g.index], k, start_tokens)

    candidates = [k for k in range(1, n_chunks + 1) if start_tokens < k * chunk < prompt_len]
    best = max((k for k in candidates if all(ok(g, k) for g in groups)), default=0)
    per_group = tuple(max((k for k in candidates if ok(g, k)), default=0) * chunk for g in groups)
    return best * chunk, per_group


CHUNKS = (16, 32, 48, 64, 128)
KINDS = ("fa", "sw", "sw", "mamba", "mamba_multi", "mamba_none")
# module-level strategies: building strategies inside a composite dominates the run time
_CHUNK = st.sampled_from(CHUNKS)
_KIND = st.sampled_from(KINDS)
_SMALL = st.integers(0, 15)
_N_GROUPS = st.integers(1, 4)
# hypothesis favours small integers: count chunks down from 12 so most prompts are long
_N_CHUNKS = st.integers(0, 12).map(lambda x: 12 - x)
_MASK = st.integers(0, (1 << 12) - 1)
_BIG = st.integers(0, 1 << 20)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple:
    chunk = draw(_CHUNK)
    divisors = [d for d in range(4, chunk + 1) if chunk % d == 0]

    def block_dividing_or_multiple() -> int:
        pick = draw(_SMALL)
        return divisors[pick % len(divisors)] if pick < 10 else chunk * (pick - 9)

    groups: list[GroupSpec] = []
    for i in range(draw(_N_GROUPS)):
        kind = draw(_KIND)
        if kind == "fa":
            groups.append(fa(i, block_dividing_or_multiple(), layers=1))
        elif kind == "sw":
            # windows near chunk multiples are where off-by-one errors live
            m, pick, r = 1 + draw(_SMALL) % 5, draw(_SMALL), draw(_BIG)
            windows = (m * chunk + 1, m * chunk, m * chunk - 1, m * chunk + 2, 2 + r % (6 * chunk))
            window = windows[pick % 5]
            groups.append(sw(i, block_dividing_or_multiple(), window=window, layers=1))
        elif kind == "mamba":  # block divides the chunk or equals it
            groups.append(mamba(i, divisors[draw(_SMALL) % len(divisors)], layers=1))
        elif kind == "mamba_multi":  # one block is several chunks
            groups.append(mamba(i, chunk * (2 + draw(_SMALL) % 3), layers=1))
        else:
            groups.append(mamba(i, 1 + draw(_BIG) % 100_000, "none", layers=1))
    n_chunks = draw(_N_CHUNKS)
    presence = []
    for _ in groups:
        short = draw(_SMALL)
        length = n_chunks if short < 12 else short % (n_chunks + 1)
        # a chunk is missing where all drawn masks have a 1: 1/2, 1/4 or 1/8 of the chunks,
        # so that long prefixes occur too; sometimes (short == 11) nothing is missing at all
        holes = 0 if short == 11 else draw(_MASK)
        for _ in range(draw(_SMALL) % 3):
            holes &= draw(_MASK)
        presence.append([not (holes >> i) & 1 for i in range(length)])
    # prompt lengths at, just below and just above chunk boundaries, or anywhere
    mode, raw = draw(_SMALL), draw(_BIG)
    boundary = (n_chunks + 1 - raw % (n_chunks + 2)) * chunk
    prompt_len = max(0, (boundary, boundary - 1, boundary + 1)[mode % 3] if mode < 12
                     else raw % ((n_chunks + 2) * chunk + 1))
    mode, raw = draw(_SMALL), draw(_BIG)
    if mode < 6:
        start_tokens = 0
    elif mode < 10:
        start_tokens = raw % (prompt_len + chunk + 1)
    else:
        start_tokens = (raw % (n_chunks + 2)) * chunk
    return chunk, tuple(groups), presence, prompt_len, start_tokens


@PROPERTY_SETTINGS
@given(scenarios())
def test_loadable_prefix_matches_reference(scenario: tuple) -> None:
    chunk, groups, presence, prompt_len, start_tokens = scenario
    p = planner(*groups, chunk=chunk)
    result = p.loadable_prefix(presence, prompt_len, start_tokens)
    want_tokens, want_per_group = reference(groups, chunk, presence, prompt_len, start_tokens)
    assert result.tokens == want_tokens
    assert result.per_group_tokens == want_per_group
    assert result.groups_disagree == any(t != want_tokens for t in want_per_group)
    if result.tokens:
        assert result.tokens % chunk == 0 and start_tokens < result.tokens < prompt_len
        k, start = result.tokens // chunk, start_tokens // chunk
        for plan in p.plans:  # everything the connector will load is present
            assert all(presence[plan.index][c] for c in p.needed_chunks(plan, k, start))
    # every boundary, not just the answer: the per-group rule itself
    start = start_tokens // chunk
    for plan in p.plans:
        pres = presence[plan.index]
        for k in range(start + 1, len(pres) + 1):
            want = reference_allows(plan.group, chunk, pres, k, start_tokens)
            assert p.group_allows(plan, k, pres, start) == want, (plan.index, k)


@PROPERTY_SETTINGS
@given(scenarios(), st.binary(max_size=8))
def test_lookup_matches_loadable_prefix(scenario: tuple, scope: bytes) -> None:
    chunk, groups, presence, prompt_len, start_tokens = scenario
    p = planner(*groups, chunk=chunk)
    n_chunks = max((len(g) for g in presence), default=0)
    hashes = p.chunk_hashes(tokens(n_chunks * chunk + 3), scope)
    all_keys = p.group_keys(hashes)
    keys = [all_keys[g][: len(presence[g])] for g in range(len(groups))]
    stored = {key: bit for gk, gp in zip(keys, presence, strict=True)
              for key, bit in zip(gk, gp, strict=True)}
    calls: list[list[str]] = []

    def contains(batch: list[str]) -> list[bool]:
        calls.append(list(batch))
        return [stored[key] for key in batch]

    got = p.lookup(keys, contains, prompt_len, start_tokens)
    assert got == p.loadable_prefix(presence, prompt_len, start_tokens)
    k_max = min(p.max_boundary_chunks(prompt_len), *(len(g) for g in presence))
    assert len(calls) == (1 if k_max > start_tokens // chunk else 0)


@PROPERTY_SETTINGS
@given(scenarios(), st.sampled_from([1, 2, 4]))
def test_probed_lookup_loads_what_asking_everything_loads(scenario: tuple, probes: int) -> None:
    """Asking state groups only at boundaries the other groups allow, highest first, changes
    the keys asked, never the prefix loaded."""
    chunk, groups, presence, prompt_len, start_tokens = scenario
    p = planner(*groups, chunk=chunk)
    n_chunks = max((len(g) for g in presence), default=0)
    all_keys = p.group_keys(p.chunk_hashes(tokens(n_chunks * chunk + 3)))
    keys = [all_keys[g][: len(presence[g])] for g in range(len(groups))]
    stored = {key: bit for gk, gp in zip(keys, presence, strict=True)
              for key, bit in zip(gk, gp, strict=True)}
    asked: list[str] = []
    calls = 0

    def contains(batch: list[str]) -> list[bool]:
        nonlocal calls
        calls += 1
        asked.extend(batch)
        return [stored[key] for key in batch]

    got = p.lookup(keys, contains, prompt_len, start_tokens, state_probes=probes)
    want = p.loadable_prefix(presence, prompt_len, start_tokens)
    assert (got.tokens, got.attention_tokens) == (want.tokens, want.attention_tokens)
    for plan in p.plans:
        if plan.kind is not GroupKind.MAMBA:
            assert got.per_group_tokens[plan.index] == want.per_group_tokens[plan.index]
    assert len(asked) == len(set(asked)) and calls <= 3


def test_probed_lookup_of_a_full_hit_asks_one_state_page_per_group() -> None:
    p = hybrid()
    keys = p.group_keys(p.chunk_hashes(tokens(40 * C)))
    asked: list[str] = []

    def contains(batch: list[str]) -> list[bool]:
        asked.extend(batch)
        return [True] * len(batch)

    full = p.lookup(keys, contains, 40 * C + 1)
    everything, asked[:] = len(asked), []
    probed = p.lookup(keys, contains, 40 * C + 1, state_probes=4)
    assert probed.tokens == full.tokens == 40 * C
    states = [pl.index for pl in p.plans if pl.kind is GroupKind.MAMBA]
    assert states and len(asked) == everything - len(states) * (40 - 4)


GPU_BLOCKS = [(544, 32, 16), (272, 16, 16), (1056, 32, 16), (528, 16, 16), (1040, 16, 16), (640, 128, 16)]


@pytest.mark.parametrize(("block", "cpu", "gpu"), GPU_BLOCKS)
def test_on_a_gpu_the_default_chunk_divides_every_tp_sizes_block(block: int, cpu: int, gpu: int) -> None:
    """GPU engines align hybrid blocks to 16 tokens at every TP size: the default chunk is 16
    there whatever this engine's block, so engines at other TP sizes cut the same chunks."""
    groups = (fa(0, block), mamba(1, block))
    assert default_chunk_tokens(groups) == cpu
    assert default_chunk_tokens(groups, hybrid_alignment=16) == gpu
    assert HybridOffloadPlanner(model(*groups), hybrid_alignment=16).chunk_tokens == gpu
    assert HybridOffloadPlanner(model(*groups), cpu, hybrid_alignment=16).chunk_tokens == cpu  # configured
    assert default_chunk_tokens((fa(0, 16),), hybrid_alignment=16) == 256  # attention only: unchanged
