"""The data path on vLLM 0.32's GPU KV cache layouts, without vLLM: requests stored from one
cache into the cpu and disk tiers load bit-identically into other block ids, other layouts and
other TP sizes. Runs on ``cpu`` in ``make test`` and on ``cuda`` where there is one (torch alone:
``scripts/gpu_check.sh`` runs this module on the GPU machine)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hybrid_offload.backends import BackendConfig
from hybrid_offload.testing.datapath import HybridShape, KVWorld, changed_blocks, fill_random, kv_bytes_at

DEVICES = [
    "cpu",
    "cpu+gpu-path",  # the GPU's code (loads written on the load thread, stores on the store thread)
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
#: vLLM 0.32's layouts a hybrid model can get (block-compact: mixed page shapes)
LAYOUTS = ["LBNHC", "LBHNC", "BLHNC", "BLNHC"]
SMALL = HybridShape(attn_layers=2, kv_heads=4, head_size=64, gdn_layers=4, k_heads=2, v_heads=4,
                    head_k=16, head_v=32, group_layers=2)  # fmt: skip


def tiers(kind: str, root: Path, capacity: int = 1 << 30) -> list[BackendConfig]:
    """One tier; a GPU worker page-locks a cpu tier's whole arena, so it is sized for the test."""
    if kind == "cpu":
        return [BackendConfig("cpu", "cpu", capacity)]
    return [BackendConfig("disk", "disk", capacity, {"path": str(root / "disk")})]


def tokens_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def blocks_for(shape: HybridShape, n: int) -> int:
    """A cache for two block tables of ``n`` tokens, block 0 and two state blocks
    (``blocks - 2``: the writer's, ``blocks - 1``: the reader's)."""
    return 2 * -(-n // shape.block_size()) + 3


def tables(world: KVWorld, n: int) -> tuple[list[int], list[int]]:
    """Two disjoint scrambled block tables for ``n`` tokens (blocks 1.. of the cache)."""
    need = -(-n // world.block_size)
    order = torch.randperm(2 * need, generator=torch.Generator().manual_seed(n)) + 1
    return order[:need].tolist(), order[need:].tolist()


def assert_same_kv(src: KVWorld, src_table: list[int], dst: KVWorld, dst_table: list[int], n: int,
                   heads: slice = slice(None), dst_heads: slice = slice(None)) -> None:  # fmt: skip
    for name in src.spec.groups[0].layer_names:
        want = kv_bytes_at(src.views[name], src_table, src.block_size, range(n))[:, heads]
        got = kv_bytes_at(dst.views[name], dst_table, dst.block_size, range(n))[:, dst_heads]
        assert torch.equal(want, got), f"{name}: K/V bytes differ"


def loaded_tokens(world: KVWorld, n: int) -> int:
    return n // world.chunk * world.chunk


def round_trip(writer: KVWorld, reader: KVWorld, tier: str, n: int, seed: int) -> None:
    """Random KV and states in ``writer``; a request of ``n`` tokens stored from one block table
    and loaded by ``reader`` into another: the loaded tokens and states are bit-identical."""
    blocks = writer.spec.num_blocks
    fill_random(writer.raw, seed)
    tokens = tokens_of(n, seed)
    src, dst = tables(writer, n)
    writer.store(writer.pages(tokens, src, blocks - 2), [tier])
    assert reader.load(reader.pages(tokens, dst, blocks - 1), tier)
    assert_same_kv(writer, src, reader, dst, loaded_tokens(writer, n))
    for g in writer.spec.groups[1:]:
        assert torch.equal(writer.state_bytes(g.index, blocks - 2), reader.state_bytes(g.index, blocks - 1))


@pytest.fixture
def worlds(tmp_path: Path) -> Iterator[list[KVWorld]]:
    made: list[KVWorld] = []
    yield made
    for w in made:
        w.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "uint8"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_request_loads_bit_identical_into_other_blocks(
    device: str, layout: str, kv_dtype: str, tier: str, tmp_path: Path, worlds: list[KVWorld]
) -> None:
    shape = HybridShape(**{**SMALL.__dict__, "kv_dtype": kv_dtype})
    n = 1000 + 37  # not a multiple of a chunk or a block
    blocks = blocks_for(shape, n)
    w = KVWorld(shape, blocks, layout, device, tiers(tier, tmp_path))
    worlds.append(w)
    fill_random(w.raw, 1)
    tokens = tokens_of(n)
    src, dst = tables(w, n)
    w.store(w.pages(tokens, src, blocks - 2), [tier])
    before = w.raw.clone()
    assert w.load(w.pages(tokens, dst, blocks - 1), tier)
    m = loaded_tokens(w, n)
    assert_same_kv(w, src, w, dst, m)
    for g in w.spec.groups[1:]:
        assert torch.equal(w.state_bytes(g.index, blocks - 2), w.state_bytes(g.index, blocks - 1))
    # nothing else moved: only the blocks of the loaded tokens and the state block changed
    assert changed_blocks(w, before) == {*dst[: -(-m // w.block_size)], blocks - 1}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("writer", "reader"), [("LBNHC", "BLHNC"), ("BLNHC", "LBHNC")])
def test_pages_written_in_one_layout_load_in_another(
    device: str, writer: str, reader: str, tmp_path: Path, worlds: list[KVWorld]
) -> None:
    n = 3000 + 5
    blocks = blocks_for(SMALL, n)
    a = KVWorld(SMALL, blocks, writer, device, tiers("disk", tmp_path))
    b = KVWorld(SMALL, blocks, reader, device, tiers("disk", tmp_path))  # another engine, same disk
    worlds.extend([a, b])
    round_trip(a, b, "disk", n, 1)


def _tp1_state(shape: HybridShape, ranks: list[torch.Tensor]) -> torch.Tensor:
    """Per layer, the TP=1 state bytes assembled from TP ranks' state bytes (conv (k-1, q|k|v)
    split per component along dim 1; SSM split by value heads)."""
    t = len(ranks)
    item = getattr(torch, shape.dtype).itemsize
    conv1, _ = shape.state_shapes(1)
    convt, ssmt = shape.state_shapes(t)
    out = []
    for layer in range(ranks[0].shape[0]):
        convs, ssms = [], []
        for r in ranks:
            b = r[layer]
            conv = b[: conv1[0] * convt[1] * item].view(conv1[0], convt[1] * item)
            convs.append(conv)
            ssms.append(b[conv.numel() : conv.numel() + ssmt[0] * ssmt[1] * ssmt[2] * item])
        qk, v = shape.k_heads * shape.head_k * item // t, shape.v_heads * shape.head_v * item // t
        parts = [torch.cat([c[:, i * qk : (i + 1) * qk] for c in convs], 1) for i in range(2)]
        parts.append(torch.cat([c[:, 2 * qk : 2 * qk + v] for c in convs], 1))
        out.append(torch.cat([torch.cat(parts, 1).flatten(), *ssms]))
    return torch.stack(out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("write_tp", "read_tp"), [(2, 1), (1, 2)])
def test_pages_written_at_one_tp_size_load_at_another(
    device: str, write_tp: int, read_tp: int, tmp_path: Path, worlds: list[KVWorld]
) -> None:
    n = 2000 + 11
    blocks = blocks_for(SMALL, n)
    tokens = tokens_of(n, 2)
    writers = [KVWorld(SMALL, blocks, "LBNHC", device, tiers("disk", tmp_path), tp_size=write_tp, tp_rank=r)
               for r in range(write_tp)]  # fmt: skip
    readers = [KVWorld(SMALL, blocks, "BLHNC", device, tiers("disk", tmp_path), tp_size=read_tp, tp_rank=r)
               for r in range(read_tp)]  # fmt: skip
    worlds.extend(writers + readers)
    src, dst = tables(writers[0], n)
    for r, w in enumerate(writers):
        fill_random(w.raw, 10 + r)
        w.store(w.pages(tokens, src, blocks - 2), ["disk"])
    for r in readers:
        assert r.load(r.pages(tokens, dst, blocks - 1), "disk")
    m = loaded_tokens(writers[0], n)
    heads = SMALL.kv_heads
    for r, w in enumerate(writers):  # each writer's heads are the same heads on the reader side
        per_w = heads // write_tp
        for q, rd in enumerate(readers):
            per_r = heads // read_tp
            lo, hi = max(r * per_w, q * per_r), min((r + 1) * per_w, (q + 1) * per_r)
            if lo < hi:
                assert_same_kv(w, src, rd, dst, m, slice(lo - r * per_w, hi - r * per_w),
                               slice(lo - q * per_r, hi - q * per_r))  # fmt: skip
    for g in writers[0].spec.groups[1:]:
        written = _tp1_state(SMALL, [w.state_bytes(g.index, blocks - 2) for w in writers])
        read = _tp1_state(SMALL, [rd.state_bytes(g.index, blocks - 1) for rd in readers])
        assert torch.equal(written, read)


@pytest.mark.parametrize(
    ("device", "n"),
    [("cpu", 16_000 + 3),
     pytest.param("cuda", 64 * 1024 + 3, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="no CUDA device"))],
)  # fmt: skip
def test_a_long_request_of_a_qwen3_next_shaped_cache(device: str, n: int, tmp_path: Path,
                                                     worlds: list[KVWorld]) -> None:  # fmt: skip
    """Qwen3-Next-80B's page geometry (2 KV heads x 256, GDN states), fewer layers on CPU."""
    from hybrid_offload.testing.datapath import QWEN3_NEXT_80B

    layers = {} if device == "cuda" else {"attn_layers": 1, "gdn_layers": 3, "group_layers": 1}
    shape = HybridShape(**{**QWEN3_NEXT_80B.__dict__, **layers})
    blocks = blocks_for(shape, n)
    w = KVWorld(shape, blocks, "LBNHC", device, tiers("cpu", tmp_path, 4 << 30), staging_pool_bytes=4 << 30)
    worlds.append(w)
    round_trip(w, w, "cpu", n, 3)


@pytest.mark.parametrize("device", DEVICES)
def test_the_checksum_twin_gives_the_hosts_value_on_the_device(device: str) -> None:
    """fold64 on the device (after a load's copy) equals the host's (at a store's seal)."""
    from hybrid_offload.connector.worker.device_checksum import fold64_rows
    from hybrid_offload.core.checksum import fold64

    gen = torch.Generator().manual_seed(5)
    for nbytes in (8, 13, 4096 + 3, 786_432, 3 << 20):
        block = torch.randint(0, 256, (4, -(-nbytes // 64) * 64), dtype=torch.uint8, generator=gen)
        got = fold64_rows(block.to(device.partition("+")[0])[:, :nbytes]).cpu().tolist()
        assert [v & ((1 << 64) - 1) for v in got] == [fold64(r[:nbytes].numpy().tobytes()) for r in block]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["cpu", "disk"])
@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_corrupt_page_in_a_tier_is_a_miss(device: str, tier: str, where: str, tmp_path: Path,
                                            worlds: list[KVWorld]) -> None:  # fmt: skip
    """One flipped byte of one page (in the cpu tier's arena itself, or in the disk file's
    bytes): the load fails (vLLM recomputes), the page is counted bad and deleted, and the
    pages stored again then load bit-identically."""
    n = 700 + 5
    blocks = blocks_for(SMALL, n)
    w = KVWorld(SMALL, blocks, "LBNHC", device, tiers(tier, tmp_path))
    worlds.append(w)
    fill_random(w.raw, 6)
    tokens = tokens_of(n, 6)
    src, dst = tables(w, n)
    stored = w.pages(tokens, src, blocks - 2)
    w.store(stored, [tier])
    backend = w.worker.backends[tier]
    victim = w.planner.piece_key(stored[3].key, stored[3].group, w.worker.codecs[stored[3].group].read[0])
    lease = backend.lease_batch([victim])
    view = lease.views[0]
    assert view is not None
    at = 10 if where == "header" else view.nbytes - 7
    if backend.in_place:  # the arena's own byte
        assert lease.memory is not None and lease.offsets[0] is not None
        lease.memory[lease.offsets[0] + at] ^= 0x10
    else:
        page = bytearray(view)
        page[at] ^= 0x10
        backend.put_batch([(victim, bytes(page))])
    lease.release()
    assert not w.load(w.pages(tokens, dst, blocks - 1), tier)
    counters = w.worker.stats.snapshot()
    assert counters["bad_pages"] == 1
    assert backend.contains_batch([victim]) == [False]
    w.store(stored, [tier])
    assert w.load(w.pages(tokens, dst, blocks - 1), tier, req_id="again")
    assert_same_kv(w, src, w, dst, loaded_tokens(w, n))
