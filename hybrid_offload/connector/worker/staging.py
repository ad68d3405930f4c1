"""Where a load's pieces land before they are written into vLLM's KV cache, and where a step's
stores are copied out of it.

Worker side. A piece (layer part x TP shard, :class:`~hybrid_offload.core.planner.Piece`) is
one page of a page set. The pages a load reads from a backend that does not
lend them in place land in rows of one block (:func:`stage_reads`), allocated once (not zeroed),
the rows of one (group, piece) side by side, so :mod:`.load_writes` writes them as runs.

A piece read again from a fallback backend lands in a fresh buffer, never in its row: a
backend that failed may still be writing into the buffers it was given. For the same reason a
load's staging memory goes back to its :class:`~.memory_pool.MemoryPool` only if no read into it
failed.

Stores mirror loads (:func:`gather_rows`): a step's pages of each (group, piece) are copied out
into the rows of one block, attention pages with one copy per layer and K/V, and each row is the
page buffer the backends are given.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from hybrid_offload.connector.metadata import StoreJob
from hybrid_offload.connector.worker.device import DeviceTransfers
from hybrid_offload.connector.worker.device_checksum import fold64_rows
from hybrid_offload.connector.worker.load_writes import ShardRead, row_width, side_by_side
from hybrid_offload.connector.worker.memory_pool import MemoryPool
from hybrid_offload.connector.worker.page_codec import PageCodec
from hybrid_offload.core.planner import Piece
from hybrid_offload.engine.kv_layout import AttentionGroupLayout, MambaGroupLayout

Layout = AttentionGroupLayout | MambaGroupLayout


class StorePiece(NamedTuple):
    """One piece of a page to store: its job, the piece and its page buffer (header not yet sealed)."""

    job: StoreJob
    piece: Piece
    buffer: bytearray | memoryview


def stage_reads(reads: Sequence[ShardRead], pool: MemoryPool) -> tuple[list[int], torch.Tensor | None]:
    """Where each read's first copy lands: its byte offset in one block from ``pool`` (None
    when there is nothing to read), the rows of each (group, piece) side by side at
    :func:`~.load_writes.row_width` (so a run of them is copied to the device at once). Give the
    block back once nothing writes into it."""
    counts = Counter((r.page.group, r.piece) for r in reads)
    widths = {(r.page.group, r.piece): row_width(r.page_len) for r in reads}
    starts, total = {}, 0
    for at, n in counts.items():
        starts[at] = total
        total += n * widths[at]
    if not total:
        return [0] * len(reads), None
    block = pool.take(total)
    offsets = []
    for r in reads:
        at = (r.page.group, r.piece)
        offsets.append(starts[at])
        starts[at] += widths[at]
    return offsets, block


def _places(jobs: Sequence[StoreJob], codecs: Mapping[int, PageCodec]) -> tuple[list[Place], int]:
    """Where each (group, piece)'s rows of ``jobs`` go in one block, and its size."""
    by_group: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        by_group.setdefault(job.page.group, []).append(i)
    places, total = [], 0
    for group, idxs in by_group.items():
        for piece in codecs[group].written:
            width = row_width(codecs[group].page_lens[piece])
            places.append(Place(group, idxs, piece, width, total))
            total += len(idxs) * width
    return places, total


@dataclass(frozen=True)
class Place:
    """The rows of one (group, piece) of a step's stores in a block: the jobs (indices), at
    ``offset``, ``width`` apart."""

    group: int
    jobs: list[int]
    piece: Piece
    width: int
    offset: int


def _gather(block: torch.Tensor, places: Sequence[Place], jobs: Sequence[StoreJob],
            codecs: Mapping[int, PageCodec], layouts: Mapping[int, Layout]) -> None:  # fmt: skip
    """Copy the payloads of ``jobs``' pages out of vLLM's KV cache into their rows of ``block``
    (on its device: the current stream); headers are left to sealing."""
    for place in places:
        codec, layout, pages = codecs[place.group], layouts[place.group], [jobs[i].page for i in place.jobs]
        plen, hlen, n = codec.page_lens[place.piece], codec.header_lens[place.piece], len(place.jobs)
        rows = block[place.offset : place.offset + n * place.width].view(n, place.width)[:, :plen]
        if not codec.gather_rows(layout, place.piece, rows, pages):
            for row, page in zip(rows, pages, strict=True):
                codec.gather(layout, page, place.piece, row[hlen:])


def gather_rows(
    jobs: Sequence[StoreJob], codecs: Mapping[int, PageCodec], layouts: Mapping[int, Layout],
    pool: MemoryPool | None, transfers: DeviceTransfers | None = None,
) -> tuple[list[StorePiece], list[torch.Tensor]]:  # fmt: skip
    """Copy the pieces this rank writes of ``jobs``' pages out of vLLM's KV cache (model-runner
    thread), per (group, piece) into rows of one host block from ``pool`` (None: a new block).
    Returns the pieces (page buffer: a row, header not yet sealed) in job order and piece
    order, and the blocks: give them back once no backend reads the buffers.

    On a device with its own memory the rows are gathered into a device block and copied to the
    host block on the store stream: wait for ``transfers.stored()`` before reading them (the
    step's stores take :func:`gather_on_device` there; held copies take this)."""
    transfers = transfers or DeviceTransfers()
    places, total = _places(jobs, codecs)
    if not total:
        return [], []
    host = pool.take(total) if pool is not None else torch.empty(total, dtype=torch.uint8)
    gathered = transfers.gather_block(host, total)
    _gather(gathered, places, jobs, codecs, layouts)
    transfers.store_copy(gathered[:total], host)
    whole = host.numpy().data.cast("B")  # rows are slices of it (one view, not one per row)
    buffers: dict[tuple[int, Piece], memoryview] = {}
    for place in places:
        plen = codecs[place.group].page_lens[place.piece]
        for k, i in enumerate(place.jobs):
            at = place.offset + k * place.width
            buffers[(i, place.piece)] = whole[at : at + plen]
    entries = [StorePiece(job, piece, buffers[(i, piece)]) for i, job in enumerate(jobs)
               for piece in codecs[job.page.group].written]  # fmt: skip
    return entries, [host]


class GatheredRow(NamedTuple):
    """One row of :class:`GatheredRows`: its place, row within it, job, position among all rows."""

    place: Place
    row: int
    job: StoreJob
    position: int


@dataclass
class GatheredRows:
    """A step's stores copied out of vLLM's KV cache (:func:`gather_on_device`,
    :func:`gather_on_host`): per :class:`Place` the rows of ``block`` (on the KV cache's
    device)."""

    jobs: list[StoreJob]
    places: list[Place]
    block: torch.Tensor
    #: on a GPU: complete once the gather is (recorded on the compute stream)
    gathered: torch.cuda.Event | None = None

    def rows(self) -> Iterator[GatheredRow]:
        """Every row, place by place."""
        n = 0
        for place in self.places:
            for k, i in enumerate(place.jobs):
                yield GatheredRow(place, k, self.jobs[i], n)
                n += 1

    @property
    def count(self) -> int:
        return sum(len(place.jobs) for place in self.places)


def gather_on_host(
    jobs: Sequence[StoreJob], codecs: Mapping[int, PageCodec], layouts: Mapping[int, Layout], pool: MemoryPool
) -> GatheredRows | None:  # fmt: skip
    """Gather a step's stores into rows of one block from ``pool`` (CPU engines, model-runner
    thread): the store thread seals them there and copies those a tier keeps in place."""
    places, total = _places(jobs, codecs)
    if not total:
        return None
    block = pool.take(total)
    _gather(block, places, jobs, codecs, layouts)
    return GatheredRows(list(jobs), places, block)


def gather_on_device(
    jobs: Sequence[StoreJob], codecs: Mapping[int, PageCodec], layouts: Mapping[int, Layout],
    transfers: DeviceTransfers,
) -> GatheredRows | None:  # fmt: skip
    """Gather a step's stores into one device block (model-runner thread, compute stream: the
    next forward may overwrite the blocks once these kernels ran) and mark their end: the store
    thread checksums the rows there (:func:`device_sums`), copies them straight to where they
    are kept (the cpu tier's arena) and seals them with those sums, no host pass over the
    bytes and no further work on this thread."""
    places, total = _places(jobs, codecs)
    if not total:
        return None
    block = torch.empty(total, dtype=torch.uint8, device=transfers.device)
    _gather(block, places, jobs, codecs, layouts)
    return GatheredRows(list(jobs), places, block, gathered=transfers.event())


def device_sums(rows: GatheredRows, codecs: Mapping[int, PageCodec]) -> torch.Tensor:
    """The payload checksum of every row of ``rows`` (int64 on its device, in
    :meth:`GatheredRows.rows` order), enqueued on the current stream after the gather."""
    if rows.gathered is not None:
        torch.cuda.current_stream(rows.block.device).wait_event(rows.gathered)
    sums = []
    for place in rows.places:
        codec = codecs[place.group]
        plen, hlen, n = codec.page_lens[place.piece], codec.header_lens[place.piece], len(place.jobs)
        block = rows.block[place.offset : place.offset + n * place.width].view(n, place.width)
        sums.append(fold64_rows(block[:, hlen:plen]))
    return torch.cat(sums)


def copy_rows(
    rows: GatheredRows, entries: Sequence[GatheredRow],
    dest: Sequence[tuple[torch.Tensor, int]], plens: Sequence[int],
) -> None:  # fmt: skip
    """Copy each row of ``rows`` (``entries``, as :meth:`GatheredRows.rows` lists them) to
    ``dest`` (a host tensor and byte offset; rows already there are skipped), one copy per run
    of rows side by side at both ends: from a device enqueued on the current stream, on the
    host with numpy (without the GIL)."""
    on_host = not rows.block.is_cuda
    first = 0
    while first < len(entries):  # the entries of one place are consecutive, rows in order
        place = entries[first].place
        end = first
        while end < len(entries) and entries[end].place is place:
            end += 1
        where = [(id(dest[n][0]), dest[n][1]) for n in range(first, end)]
        for run in side_by_side(where, place.width):
            n = first + run.start
            base, start = dest[n]
            span = (len(run) - 1) * place.width + plens[n]
            at = place.offset + entries[n].row * place.width
            if base is rows.block and start == at:
                continue  # kept where it was gathered
            if on_host:
                np.copyto(base.numpy()[start : start + span], rows.block.numpy()[at : at + span])
            else:
                base[start : start + span].copy_(rows.block[at : at + span], non_blocking=True)
        first = end
