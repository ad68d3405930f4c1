"""Staged loads (connector.staging): rows per (group, shard), written in one batch per layer, K/V
and head run, bit-identical to writing page by page, over vLLM's real CPU attention layout."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from hybrid_offload.connector.metadata import PageJob, StoreJob
from hybrid_offload.connector.worker.device import DeviceTransfers
from hybrid_offload.connector.worker.load_writes import (
    ShardRead,
    Verified,
    plan_writes,
    row_width,
    runs_of,
    write_on_device,
    write_pages,
)
from hybrid_offload.connector.worker.memory_pool import MemoryPool
from hybrid_offload.connector.worker.page_codec import PageCodec
from hybrid_offload.connector.worker.staging import gather_rows, stage_reads
from hybrid_offload.core.checksum import fold64
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


def staged(spec: ModelSpec, pages: list[PageJob], seed: int = 0) -> list[Verified]:
    """Every piece this rank reads of ``pages``, in staging rows filled with random payloads
    (and the checksums they state, for the device path's check)."""
    codec = PageCodec(spec, spec.groups[0], CHUNK)
    reads = [ShardRead(p, s, f"{p.key}/{s}", codec) for p in pages for s in codec.read]
    offsets, block = stage_reads(reads, MemoryPool(1 << 30))
    assert block is not None
    gen = torch.Generator().manual_seed(seed)
    out = []
    for r, offset in zip(reads, offsets, strict=True):
        hlen = codec.header_lens[r.piece]
        payload = block[offset + hlen : offset + r.page_len]
        payload.copy_(torch.randn(payload.numel() // 2, generator=gen).to(torch.bfloat16).view(torch.uint8))
        out.append(Verified(r, block, offset, "cpu", fold64(payload.numpy().tobytes())))
    return out


def alone(v: Verified) -> Verified:
    """``v`` in a buffer of its own (a fallback read)."""
    own = v.base[v.offset : v.offset + v.read.page_len].clone()
    return dataclasses.replace(v, base=own, offset=0)


def payload(v: Verified) -> torch.Tensor:
    return v.base[v.offset + v.read.codec.header_lens[v.read.piece] : v.offset + v.read.page_len]


def page_by_page(spec: ModelSpec, pages: list[Verified], strided: bool = False) -> dict[str, torch.Tensor]:
    kv = caches(spec, strided)
    layout = build_layouts(spec.groups, kv, NUM_BLOCKS)[0]
    for v in pages:
        v.read.codec.scatter(layout, v.read.page, v.read.piece, payload(v))
    return kv


def written(spec: ModelSpec, pages: list[Verified], strided: bool, device_path: bool,
            layout_of: Callable[[AttentionGroupLayout], AttentionGroupLayout] = lambda x: x,
            ) -> dict[str, torch.Tensor]:  # fmt: skip
    kv = caches(spec, strided)
    layout = build_layouts(spec.groups, kv, NUM_BLOCKS)[0]
    assert isinstance(layout, AttentionGroupLayout)
    layouts = {0: layout_of(layout)}
    if device_path:
        assert write_on_device(pages, layouts, (), DeviceTransfers(), None).wait() == []
    else:
        write_pages(plan_writes(pages, layouts), layouts)
    return kv


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device-path"])
@pytest.mark.parametrize(("tp_size", "tp_rank", "max_shards"), [(1, 0, 1), (1, 0, 4), (2, 1, 2), (2, 0, 4)])
def test_batched_rows_write_what_page_by_page_writes(
    tp_size: int, tp_rank: int, max_shards: int, device_path: bool
) -> None:
    spec = spec_at(tp_size, tp_rank, max_shards)
    pages = staged(spec, [page(0, skip=5), *(page(c) for c in range(1, 6))])
    kv = written(spec, pages, True, device_path)
    want = page_by_page(spec, pages, strided=True)
    for name in LAYERS:
        assert torch.equal(kv[name], want[name])
        assert kv[name].count_nonzero() > 0


def test_the_device_path_names_pages_whose_payload_is_not_what_they_state() -> None:
    spec = spec_at(1, 0, 2)
    pages = staged(spec, [page(c) for c in range(4)], seed=4)
    bad = pages[5]
    payload(bad)[17] ^= 0x40
    pages[2] = dataclasses.replace(pages[2], checksum=None)  # checked already: not checked again
    payload(pages[2])[3] ^= 1
    kv = caches(spec, True)
    layouts = {0: build_layouts(spec.groups, kv, NUM_BLOCKS)[0]}
    assert write_on_device(pages, layouts, (), DeviceTransfers(), None).wait() == [bad]


def test_runs_are_pages_side_by_side_in_one_memory() -> None:
    spec = spec_at(1, 0, 1)
    pages = staged(spec, [page(c) for c in range(6)])
    width = row_width(pages[0].read.page_len)
    assert [p.offset for p in pages] == [i * width for i in range(6)]
    shuffled = [pages[i] for i in (4, 0, 5, 1, 3)] + [alone(pages[2])]  # page 2 read elsewhere
    runs = runs_of(shuffled)
    assert [[v.read.page.chunk_index for v in r.pages] for r in runs] in (
        [[0, 1], [3, 4, 5], [2]], [[2], [0, 1], [3, 4, 5]])  # fmt: skip
    for run in runs:
        assert run.rows.shape == (len(run.pages), pages[0].read.page_len)
        for v, row in zip(run.pages, run.rows, strict=True):
            assert row.data_ptr() == v.address()


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device-path"])
def test_fallback_reads_and_gaps_are_written(device_path: bool) -> None:
    """A page read from a fallback (its own buffer, not its row) and the rows after it."""
    spec = spec_at(1, 0, 2)
    pages = staged(spec, [page(c) for c in range(5)], 1)
    pages = [alone(v) if v.read.page.chunk_index == 0 else v for v in pages]
    kv = written(spec, pages, False, device_path)
    want = page_by_page(spec, pages)
    assert all(torch.equal(kv[n], want[n]) for n in LAYERS)


def test_misaligned_rows_are_refused_and_nothing_written() -> None:
    spec = spec_at(1, 0, 1)
    pages = staged(spec, [page(1), page(2)])
    codec, piece = pages[0].read.codec, pages[0].read.piece
    (run,) = runs_of(pages)
    odd = torch.zeros((2, run.rows.shape[1] + 1), dtype=torch.uint8)[:, 1:]
    odd.copy_(run.rows)
    kv = caches(spec, strided=True)
    layout = build_layouts(spec.groups, kv, NUM_BLOCKS)[0]
    assert not codec.scatter_rows(layout, piece, odd, [v.read.page for v in pages])
    assert all(t.count_nonzero() == 0 for t in kv.values())
    assert codec.scatter_rows(layout, piece, run.rows, [v.read.page for v in pages])


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device-path"])
@pytest.mark.parametrize("by_op", [True, False], ids=["vllm-op", "by-element"])
def test_tiled_layouts_write_what_element_by_element_writes(device_path: bool, by_op: bool) -> None:
    """Kernel layouts that are not strided (AMX tiles) have no views: vLLM's cache-write op
    writes every run of rows (on the host, all runs in one call, copied side by side first),
    or every page goes alone, element by element; the same bytes either way."""
    spec = spec_at(1, 0, 2)
    pages = staged(spec, [page(c) for c in range(6)], seed=2)
    pages = [alone(v) if v.read.page.chunk_index == 2 else v for v in pages]  # two runs of rows

    def tiled(layout: AttentionGroupLayout) -> AttentionGroupLayout:
        assert layout.writes is not None  # vLLM's CPU kernel layout
        return dataclasses.replace(layout, views=None, writes=layout.writes if by_op else None)

    kv = written(spec, pages, False, device_path, tiled)
    want = caches(spec)
    layout = dataclasses.replace(build_layouts(spec.groups, want, NUM_BLOCKS)[0], views=None, writes=None)
    for v in pages:
        v.read.codec.scatter(layout, v.read.page, v.read.piece, payload(v))
    assert all(torch.equal(kv[n], want[n]) and kv[n].count_nonzero() > 0 for n in LAYERS)


def test_a_load_reuses_the_staging_memory_given_back() -> None:
    spec = spec_at(1, 0, 2)
    codec = PageCodec(spec, spec.groups[0], CHUNK)
    reads = [ShardRead(page(c), s, f"p{c}/{s}", codec) for c in range(4) for s in codec.read]
    pool = MemoryPool(1 << 30)
    offsets, block = stage_reads(reads, pool)
    assert block is not None and {o % 64 for o in offsets} == {0}
    pool.give(block)
    again, second = stage_reads(reads[:2], pool)
    assert second is block and pool.free_bytes == 0
    assert again[0] == 0


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


def test_device_sums_are_the_host_checksums_of_the_gathered_rows() -> None:
    """The store path of a GPU engine, on CPU tensors: rows gathered in one block, checksummed
    where they are (what the store thread seals them with) as the host would."""
    from hybrid_offload.connector.worker.staging import device_sums, gather_on_device

    spec = spec_at(2, 1, 4)
    kv = caches(spec)
    gen = torch.Generator().manual_seed(8)
    for t in kv.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    layout = build_layouts(spec.groups, kv, NUM_BLOCKS)[0]
    codec = PageCodec(spec, spec.groups[0], CHUNK)
    jobs = [StoreJob(page(c), ("cpu",)) for c in (2, 0, 1)]
    rows = gather_on_device(jobs, {0: codec}, {0: layout}, DeviceTransfers())
    assert rows is not None and rows.count == 3 * len(codec.written)
    sums = device_sums(rows, {0: codec}).tolist()
    for place, k, job, n in rows.rows():
        hlen, plen = codec.header_lens[place.piece], codec.page_lens[place.piece]
        at = place.offset + k * place.width
        want = torch.zeros(plen - hlen, dtype=torch.uint8)
        codec.gather(layout, job.page, place.piece, want)
        assert torch.equal(rows.block[at + hlen : at + plen], want)
        assert sums[n] & ((1 << 64) - 1) == fold64(want.numpy().tobytes())
