"""Staged loads (connector.staging): rows per (group, shard), written in one batch per layer, K/V
and head run, bit-identical to writing page by page, over vLLM's real CPU attention layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid_offload.connector.metadata import PageJob, StoreJob
from hybrid_offload.connector.worker.memory_pool import MemoryPool
from hybrid_offload.connector.worker.page_codec import PageCodec
from hybrid_offload.connector.worker.staging import Decoded, ShardRead, gather_rows, stage_reads, write_pages
from hybrid_offload.core.spec import GroupKind, GroupSpec, ModelSpec, make_model_spec
from hybrid_offload.engine.kv_layout import AttentionGroupLayout, build_layouts

TOTAL_HEADS, DIM, BS, NUM_BLOCKS, CHUNK = 4, 32, 32, 24, 48
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
#: a request's blocks, scrambled so that no page's blocks are consecutive
TABLE = [17, 3, 22, 9, 1, 14, 6, 20, 11, 2]


def spec_at(tp_size: int, tp_rank: int, max_shards: int) -> ModelSpec:
    group = GroupSpec(
        0, GroupKind.FULL_ATTENTION, BS, LAYERS, page_bytes=0, num_kv_heads=TOTAL_HEADS // tp_size,
        head_size=DIM, head_size_v=DIM, total_kv_heads=TOTAL_HEADS,
    )  # fmt: skip
    return make_model_spec(
        (group,), {"name": "staging"}, max_model_len=1024, num_blocks=NUM_BLOCKS,
        tp_rank=tp_rank, tp_size=tp_size, max_shards=max_shards,
    )  # fmt: skip


def caches(spec: ModelSpec, strided: bool = False) -> dict[str, torch.Tensor]:
    """vLLM's CPU attention layout; with ``strided``, vLLM's NHD layout where this host's CPU
    kernel layout is not strided (its ISA: AMX tiles, or AVX2 without AVX-512)."""
    heads = spec.groups[0].num_kv_heads
    cpu = {n: torch.zeros(NUM_BLOCKS, heads, BS, 2 * DIM, dtype=torch.bfloat16) for n in LAYERS}
    layout = build_layouts(spec.groups, cpu, NUM_BLOCKS)[0]
    if not strided or (isinstance(layout, AttentionGroupLayout) and layout.views is not None):
        return cpu
    return {n: torch.zeros(NUM_BLOCKS, 2, BS, heads, DIM, dtype=torch.bfloat16) for n in LAYERS}


def page(c: int, skip: int = 0) -> PageJob:
    first, last = c * CHUNK, (c + 1) * CHUNK - 1
    return PageJob(f"p{c}", 0, c, bytes(16), tuple(TABLE[first // BS : last // BS + 1]), first % BS, skip)


def staged(spec: ModelSpec, pages: list[PageJob], seed: int = 0) -> list[ShardRead]:
    """Reads of every page's shards this rank reads, their rows filled with random pages."""
    codec = PageCodec(spec, spec.groups[0], CHUNK)
    reads, _ = stage_reads(
        [(p, s, f"{p.key}/{s}", codec) for p in pages for s in codec.read], MemoryPool(1 << 30)
    )
    gen = torch.Generator().manual_seed(seed)
    for r in reads:
        r.rows[r.row] = torch.randn(r.rows.shape[1] // 2, generator=gen).to(torch.bfloat16).view(torch.uint8)
    return reads


def decoded(read: ShardRead, staged: bool = True) -> Decoded:
    hlen = read.codec.header_lens[read.shard]
    view = read.staging() if staged else memoryview(bytearray(read.staging()))
    return Decoded(read, view[hlen:], staged)


def page_by_page(spec: ModelSpec, reads: list[ShardRead], strided: bool = False) -> dict[str, torch.Tensor]:
    kv = caches(spec, strided)
    layout = build_layouts(spec.groups, kv, NUM_BLOCKS)[0]
    for r in reads:
        hlen = r.codec.header_lens[r.shard]
        r.codec.scatter(layout, r.page, r.shard, r.rows[r.row, hlen:])
    return kv


@pytest.mark.parametrize(("tp_size", "tp_rank", "max_shards"), [(1, 0, 1), (1, 0, 4), (2, 1, 2), (2, 0, 4)])
def test_batched_rows_write_what_page_by_page_writes(tp_size: int, tp_rank: int, max_shards: int) -> None:
    spec = spec_at(tp_size, tp_rank, max_shards)
    pages = [page(0, skip=5), *(page(c) for c in range(1, 6))]
    reads = staged(spec, pages)
    kv = caches(spec, strided=True)
    layout = build_layouts(spec.groups, kv, NUM_BLOCKS)[0]
    assert isinstance(layout, AttentionGroupLayout) and layout.views is not None
    write_pages([decoded(r) for r in reads], {0: layout})
    want = page_by_page(spec, reads, strided=True)
    for name in LAYERS:
        assert torch.equal(kv[name], want[name])
        assert kv[name].count_nonzero() > 0


def test_skipping_pages_take_the_last_rows() -> None:
    spec = spec_at(1, 0, 2)
    pages = [page(3, skip=7), page(4), page(5)]
    reads = staged(spec, pages)
    for shard in reads[0].codec.read:
        rows = {r.page.chunk_index: r.row for r in reads if r.shard == shard}
        assert rows == {4: 0, 5: 1, 3: 2}
    assert all(r.rows.shape == (3, r.codec.page_lens[r.shard]) for r in reads)
    first = reads[0]
    first.staging()[:4] = b"\x01\x02\x03\x04"
    assert first.rows[first.row, :4].tolist() == [1, 2, 3, 4]


def test_fallback_reads_and_gaps_are_written_page_by_page() -> None:
    """A shard read from a fallback (its own buffer, not its row) and the rows after it."""
    spec = spec_at(1, 0, 2)
    reads = staged(spec, [page(c) for c in range(5)], seed=1)
    kv = caches(spec)
    layout = build_layouts(spec.groups, kv, NUM_BLOCKS)[0]
    write_pages([decoded(r, staged=r.page.chunk_index != 0) for r in reads], {0: layout})
    want = page_by_page(spec, reads)
    assert all(torch.equal(kv[n], want[n]) for n in LAYERS)


def test_misaligned_rows_are_refused_and_nothing_written() -> None:
    spec = spec_at(1, 0, 1)
    reads = staged(spec, [page(1), page(2)])
    codec = reads[0].codec
    odd = torch.zeros((2, reads[0].rows.shape[1] + 1), dtype=torch.uint8)[:, 1:]
    odd.copy_(reads[0].rows)
    kv = caches(spec, strided=True)
    layout = build_layouts(spec.groups, kv, NUM_BLOCKS)[0]
    assert not codec.scatter_rows(layout, codec.read[0], odd, [r.page for r in reads])
    assert all(t.count_nonzero() == 0 for t in kv.values())
    assert codec.scatter_rows(layout, codec.read[0], reads[0].rows, [r.page for r in reads])


def test_element_layouts_write_page_by_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel layouts that are not strided (AMX tiles) have no views: every page goes alone."""
    spec = spec_at(1, 0, 2)
    reads = staged(spec, [page(c) for c in range(4)], seed=2)
    kv = caches(spec)
    layout = build_layouts(spec.groups, kv, NUM_BLOCKS)[0]
    assert isinstance(layout, AttentionGroupLayout)
    element = dataclasses.replace(layout, views=None)
    first = reads[0].codec.read[0]
    pages = [r.page for r in reads if r.shard == first]
    assert not reads[0].codec.scatter_rows(element, first, reads[0].rows, pages)
    write_pages([decoded(r) for r in reads], {0: element})
    want = page_by_page(spec, reads)
    assert all(torch.equal(kv[n], want[n]) for n in LAYERS)


def test_a_load_reuses_the_staging_memory_given_back() -> None:
    spec = spec_at(1, 0, 2)
    codec = PageCodec(spec, spec.groups[0], CHUNK)
    wanted = [(page(c), s, f"p{c}/{s}", codec) for c in range(4) for s in codec.read]
    pool = MemoryPool(1 << 30)
    reads, block = stage_reads(wanted, pool)
    assert {r.rows.data_ptr() % 64 for r in reads} == {0}
    assert all(r.rows.untyped_storage().data_ptr() == block.untyped_storage().data_ptr() for r in reads)
    pool.give(block)
    again, second = stage_reads(wanted[:2], pool)
    assert second is block and pool.free_bytes == 0
    assert again[0].rows.data_ptr() == block.data_ptr()


def test_the_pool_keeps_at_most_its_bytes_oldest_dropped() -> None:
    pool = MemoryPool(1000)
    small, large = pool.take(400), pool.take(700)
    pool.give(small)
    pool.give(large)  # 1100 > 1000: the oldest (small) goes
    assert pool.free_bytes == 700
    assert pool.take(100) is large
    pool.give(pool.take(5000))  # larger than the pool: not kept
    assert pool.free_bytes == 0



@pytest.mark.parametrize("strided", [True, False], ids=["strided", "element"])
@pytest.mark.parametrize(("tp_size", "tp_rank", "max_shards"), [(1, 0, 1), (1, 0, 4), (2, 1, 2), (2, 0, 4)])
def test_store_rows_hold_what_page_by_page_gathers(
    tp_size: int, tp_rank: int, max_shards: int, strided: bool
) -> None:
    """A step's stores copied out into one block's rows (one copy per layer and K/V) are the
    bytes gathered page by page, in recycled memory holding other bytes before."""
    spec = spec_at(tp_size, tp_rank, max_shards)
    kv = caches(spec)
    gen = torch.Generator().manual_seed(3)
    for t in kv.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    layout = build_layouts(spec.groups, kv, NUM_BLOCKS)[0]
    assert isinstance(layout, AttentionGroupLayout)
    layout = layout if strided else dataclasses.replace(layout, views=None)
    codec = PageCodec(spec, spec.groups[0], CHUNK)
    jobs = [StoreJob(page(c), ("cpu",)) for c in (4, 1, 2)]  # any order: entries follow it
    pool = MemoryPool(1 << 30)
    pool.give(torch.full((1 << 20,), 0xA5, dtype=torch.uint8))
    entries, blocks = gather_rows(jobs, {0: codec}, {0: layout}, pool)
    assert [(e[0], e[1]) for e in entries] == [(j, s) for j in jobs for s in codec.written]
    assert len(blocks) == 1 and pool.free_bytes == 0  # one block: one copy off a device
    for job, shard, buf in entries:
        hlen = codec.header_lens[shard]
        want = torch.zeros(codec.page_lens[shard], dtype=torch.uint8)
        codec.gather(layout, job.page, shard, want[hlen:])
        assert len(buf) == codec.page_lens[shard]
        assert bytes(buf[hlen:]) == bytes(want[hlen:].numpy())
