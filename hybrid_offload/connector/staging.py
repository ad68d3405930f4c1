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

from hybrid_offload.connector.memory_pool import MemoryPool
from hybrid_offload.connector.metadata import PageJob, StoreJob
from hybrid_offload.connector.page_codec import PageCodec
from hybrid_offload.engine.kv_layout import AttentionGroupLayout, MambaGroupLayout


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


def write_pages(
    decoded: Iterable[Decoded], layouts: Mapping[int, AttentionGroupLayout | MambaGroupLayout]
) -> None:
    """Write verified shards into vLLM's KV cache (model-runner thread): per (group, shard),
    the staged rows from the first on in one batch, the others page by page."""
    batches: dict[tuple[int, int], list[ShardRead]] = {}
    loose: dict[int, list[tuple[PageJob, int, torch.Tensor]]] = {}
    codecs: dict[int, PageCodec] = {}
    for d in decoded:
        read = d.read
        codecs[read.page.group] = read.codec
        if d.staged and not read.page.skip_tokens:
            batches.setdefault((read.page.group, read.shard), []).append(read)
        else:
            loose.setdefault(read.page.group, []).append(
                (read.page, read.shard, torch.frombuffer(d.payload, dtype=torch.uint8))
            )
    for (group, shard), reads in batches.items():
        reads.sort(key=lambda r: r.row)
        codec, rows = reads[0].codec, reads[0].rows
        if not (
            all(r.row == i for i, r in enumerate(reads))
            and codec.scatter_rows(layouts[group], shard, rows[: len(reads)], [r.page for r in reads])
        ):
            hlen = codec.header_lens[shard]
            loose.setdefault(group, []).extend((r.page, shard, rows[r.row, hlen:]) for r in reads)
    for group, pages in loose.items():
        codecs[group].scatter_pages(layouts[group], pages)


def gather_rows(
    jobs: Sequence[StoreJob], codecs: Mapping[int, PageCodec],
    layouts: Mapping[int, AttentionGroupLayout | MambaGroupLayout], pool: MemoryPool | None,
) -> tuple[list[tuple[StoreJob, int, memoryview]], list[torch.Tensor]]:  # fmt: skip
    """Copy the shards this rank writes of ``jobs``' pages out of vLLM's KV cache (model-runner
    thread), per (group, shard) into the rows of one block from ``pool`` (None: new blocks).
    Returns (job, shard, page buffer: a row, header not yet sealed) in job order and shard
    order, and the blocks: give them back once no backend reads the buffers."""
    by_group: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        by_group.setdefault(job.page.group, []).append(i)
    buffers: dict[tuple[int, int], memoryview] = {}
    blocks = []
    for group, idxs in by_group.items():
        codec, layout, pages = codecs[group], layouts[group], [jobs[i].page for i in idxs]
        for shard in codec.written:
            plen, hlen = codec.page_lens[shard], codec.header_lens[shard]
            width = -(-plen // ALIGN) * ALIGN
            n = len(idxs) * width
            block = pool.take(n) if pool is not None else torch.empty(n, dtype=torch.uint8)
            blocks.append(block)
            rows = block[:n].view(len(idxs), width)[:, :plen]
            if not codec.gather_rows(layout, shard, rows, pages):
                for row, page in zip(rows, pages, strict=True):
                    codec.gather(layout, page, shard, row[hlen:])
            for i, row in zip(idxs, rows, strict=True):
                buffers[(i, shard)] = memoryview(row.numpy()).cast("B")
    entries = [(job, shard, buffers[(i, shard)]) for i, job in enumerate(jobs)
               for shard in codecs[job.page.group].written]  # fmt: skip
    return entries, blocks
