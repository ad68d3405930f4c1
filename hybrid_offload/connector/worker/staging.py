"""Where a load's shards land before they are written into vLLM's KV cache, and where a step's
stores are copied out of it.

Worker side. A "shard" here is one page of a page set: a piece (layer part x TP shard) in
:class:`~.page_codec.PageCodec`'s numbering. Every (group, shard) of a load gets one
``(pages, page length)`` uint8 buffer, allocated once (not zeroed), and each shard read its
row: backends read into the rows in place, and :func:`write_pages` hands each attention
group's rows to
:meth:`~.page_codec.PageCodec.scatter_rows`, which moves all of them with one copy per layer,
K/V and head run. Pages that skip tokens take the last rows so that the others stay one block.

A shard read again from a fallback backend lands in a fresh buffer, never in its row: a
backend that failed may still be writing into the buffers it was given. For the same reason a
load's staging memory goes back to its :class:`~.memory_pool.MemoryPool` only if no read into it
failed.

Stores mirror loads (:func:`gather_rows`): a step's pages of each (group, shard) are copied out
into the rows of one block, attention pages with one copy per layer and K/V, and each row is the
page buffer the backends are given.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hybrid_offload.connector.metadata import PageJob, StoreJob
from hybrid_offload.connector.worker.device import DeviceTransfers
from hybrid_offload.connector.worker.memory_pool import MemoryPool
from hybrid_offload.connector.worker.page_codec import PageCodec
from hybrid_offload.engine.kv_layout import AttentionGroupLayout, MambaGroupLayout, TokenIndex, host_to_device


@dataclass(frozen=True)
class ShardRead:
    """One shard of a page to load: its backend key, this rank's codec for its group and the
    row of the load's staging buffer its first read lands in."""

    page: PageJob
    shard: int
    key: str
    codec: PageCodec
    rows: torch.Tensor
    row: int

    def staging(self) -> memoryview:
        """The staging row, writable (a backend reads into it)."""
        return memoryview(self.rows[self.row].numpy()).cast("B")


@dataclass(frozen=True)
class Decoded:
    """A verified shard: its payload (a view of the page) and whether the page is its row."""

    read: ShardRead
    payload: memoryview
    staged: bool


#: staging buffers start at multiples of this many bytes (any dtype's view is aligned)
ALIGN = 64


def stage_reads(
    wanted: Sequence[tuple[PageJob, int, str, PageCodec]], pool: MemoryPool
) -> tuple[list[ShardRead], torch.Tensor]:
    """The reads of (page, shard, key, codec), in order, each with its own staging row, and
    the pool block the rows are carved from (give it back once nothing writes into it)."""
    counts = Counter((page.group, shard) for page, shard, _, _ in wanted)
    lens = {(page.group, shard): codec.page_lens[shard] for page, shard, _, codec in wanted}
    offsets, total = {}, 0
    for at, n in counts.items():
        offsets[at] = total
        total += -(-n * lens[at] // ALIGN) * ALIGN
    block = pool.take(total)
    buffers = {
        at: block[offsets[at] : offsets[at] + n * lens[at]].view(n, lens[at]) for at, n in counts.items()
    }
    skipping = Counter((page.group, shard) for page, shard, _, _ in wanted if page.skip_tokens)
    whole = {gs: 0 for gs in counts}
    last = {gs: counts[gs] - skipping[gs] for gs in counts}
    reads = []
    for page, shard, key, codec in wanted:
        at = (page.group, shard)
        if page.skip_tokens:
            row, last[at] = last[at], last[at] + 1
        else:
            row, whole[at] = whole[at], whole[at] + 1
        reads.append(ShardRead(page, shard, key, codec, buffers[at], row))
    return reads, block


def _end(view: torch.Tensor) -> int:
    """One past the last storage element ``view`` reaches."""
    reach = sum((n - 1) * st for n, st in zip(view.shape, view.stride(), strict=True))
    return view.storage_offset() + reach + 1


def _mirror(view: torch.Tensor, host: torch.Tensor, device: torch.Tensor) -> torch.Tensor:
    """``view`` (of uint8 block ``host``) at the same place in ``device``, a copy of ``host``'s
    first bytes on the device."""
    offset = view.storage_offset() - host.storage_offset()
    return device.as_strided(view.shape, view.stride(), device.storage_offset() + offset)


@dataclass
class WritePlan:
    """A verified load, ready to be written: every per-page step done on the load thread
    (:func:`plan_writes`), so that :func:`write_pages` on the model-runner thread only enqueues
    one copy to the device and per (group, shard) one scatter per K/V and head run."""

    #: per (group, shard) written as rows: its codec, the rows (a view of the staging block),
    #: their pages and where their tokens go (on the host)
    batches: list[tuple[PageCodec, int, int, torch.Tensor, list[PageJob], TokenIndex]]
    #: per group, pages written one by one: (page, shard, payload, whether it is staged)
    loose: dict[int, list[tuple[PageJob, int, torch.Tensor, bool]]]
    codecs: dict[int, PageCodec]
    #: bytes of the staging block that hold rows
    used: int


def plan_writes(
    decoded: Iterable[Decoded], layouts: Mapping[int, AttentionGroupLayout | MambaGroupLayout],
    staging: torch.Tensor | None = None,
) -> WritePlan:  # fmt: skip
    """Sort a load's verified shards into batches of rows and loose pages (any thread)."""
    grouped: dict[tuple[int, int], list[ShardRead]] = {}
    loose: dict[int, list[tuple[PageJob, int, torch.Tensor, bool]]] = {}
    codecs: dict[int, PageCodec] = {}
    used = 0
    for d in decoded:
        read = d.read
        codecs[read.page.group] = read.codec
        if d.staged:
            used = max(used, _end(read.rows) - (0 if staging is None else staging.storage_offset()))
        if d.staged and not read.page.skip_tokens:
            grouped.setdefault((read.page.group, read.shard), []).append(read)
        elif d.staged:
            row = read.rows[read.row, read.codec.header_lens[read.shard] :]
            loose.setdefault(read.page.group, []).append((read.page, read.shard, row, True))
        else:
            payload = torch.frombuffer(d.payload, dtype=torch.uint8)
            loose.setdefault(read.page.group, []).append((read.page, read.shard, payload, False))
    batches = []
    for (group, shard), reads in grouped.items():
        reads.sort(key=lambda r: r.row)
        codec, rows, pages = reads[0].codec, reads[0].rows[: len(reads)], [r.page for r in reads]
        at = codec.row_index(layouts[group], shard, rows, pages) if all(
            r.row == i for i, r in enumerate(reads)) else None  # fmt: skip
        if at is None:
            hlen = codec.header_lens[shard]
            loose.setdefault(group, []).extend((r.page, shard, r.rows[r.row, hlen:], True) for r in reads)
        else:
            batches.append((codec, group, shard, rows, pages, at))
    return WritePlan(batches, loose, codecs, used)


def write_pages(
    plan: WritePlan | Iterable[Decoded], layouts: Mapping[int, AttentionGroupLayout | MambaGroupLayout],
    staging: torch.Tensor | None = None, transfers: DeviceTransfers | None = None,
) -> None:  # fmt: skip
    """Write a load's verified shards into vLLM's KV cache (model-runner thread), as planned
    by :func:`plan_writes` (given the shards, plans first).

    ``staging`` is the load's staging block (every staged row is a view of it); on a device
    with its own memory its used bytes go there in one copy first, and the writes read that
    copy. Call inside ``transfers.loading()``: on CUDA the work is only enqueued."""
    transfers = transfers or DeviceTransfers()
    if not isinstance(plan, WritePlan):
        plan = plan_writes(plan, layouts, staging)
    on_device = None
    if staging is not None and transfers.is_cuda:  # elsewhere the rows are read where they are
        on_device = transfers.load_copy(staging[: plan.used])

    def placed(view: torch.Tensor, staged: bool) -> torch.Tensor:
        if staged and staging is not None and on_device is not None:
            return _mirror(view, staging, on_device)
        return host_to_device(view, transfers.device)

    for codec, group, shard, rows, pages, at in plan.batches:
        written = codec.scatter_rows(layouts[group], shard, placed(rows, True), pages, at)
        assert written  # planned: row_index allowed it
    for group, items in plan.loose.items():
        plan.codecs[group].scatter_pages(layouts[group], [(page, shard, placed(payload, staged))
                                                          for page, shard, payload, staged in items])


def gather_rows(
    jobs: Sequence[StoreJob], codecs: Mapping[int, PageCodec],
    layouts: Mapping[int, AttentionGroupLayout | MambaGroupLayout], pool: MemoryPool | None,
    transfers: DeviceTransfers | None = None,
) -> tuple[list[tuple[StoreJob, int, memoryview]], list[torch.Tensor]]:  # fmt: skip
    """Copy the shards this rank writes of ``jobs``' pages out of vLLM's KV cache (model-runner
    thread), per (group, shard) into rows of one host block from ``pool`` (None: a new block).
    Returns (job, shard, page buffer: a row, header not yet sealed) in job order and shard
    order, and the blocks: give them back once no backend reads the buffers.

    On a device with its own memory the rows are gathered into a device block and copied to the
    host block on the store stream: wait for ``transfers.stored()`` before reading them."""
    transfers = transfers or DeviceTransfers()
    by_group: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        by_group.setdefault(job.page.group, []).append(i)
    places: list[tuple[int, list[int], int, int]] = []  # (group, jobs, shard, row width)
    total = 0
    for group, idxs in by_group.items():
        for shard in codecs[group].written:
            width = -(-codecs[group].page_lens[shard] // ALIGN) * ALIGN
            places.append((group, idxs, shard, width))
            total += len(idxs) * width
    if not total:
        return [], []
    host = pool.take(total) if pool is not None else torch.empty(total, dtype=torch.uint8)
    gathered = transfers.gather_block(host, total)
    buffers: dict[tuple[int, int], memoryview] = {}
    whole = memoryview(host.numpy()).cast("B")  # rows are slices of it (one view, not one per row)
    offset = 0
    for group, idxs, shard, width in places:
        codec, layout, pages = codecs[group], layouts[group], [jobs[i].page for i in idxs]
        plen, hlen, n = codec.page_lens[shard], codec.header_lens[shard], len(idxs) * width
        rows = gathered[offset : offset + n].view(len(idxs), width)[:, :plen]
        if not codec.gather_rows(layout, shard, rows, pages):
            for row, page in zip(rows, pages, strict=True):
                codec.gather(layout, page, shard, row[hlen:])
        for k, i in enumerate(idxs):
            buffers[(i, shard)] = whole[offset + k * width : offset + k * width + plen]
        offset += n
    transfers.store_copy(gathered[:total], host)
    entries = [(job, shard, buffers[(i, shard)]) for i, job in enumerate(jobs)
               for shard in codecs[job.page.group].written]  # fmt: skip
    return entries, [host]
