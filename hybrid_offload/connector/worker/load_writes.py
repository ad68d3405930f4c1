"""The writes of a load's pages into vLLM's KV cache, planned on the load thread.

Worker side. Every page of a load is a :class:`Verified`: where its bytes are on the host (a
staging row, the cpu tier's arena, or a buffer of its own) and, where its payload is still to
be checked, the checksum its header states. Pages of one (group, piece) that lie side by side
in one host memory at the same aligned width (:func:`row_width`: staging rows, and the arena's
extents of a step's stores) form *runs*:

* **CPU** (:func:`plan_writes`, then :func:`write_pages` on the model-runner thread): each run
  of attention pages is written as rows, straight from where it is (one copy per layer, K/V
  and head run, :meth:`~.page_codec.PageCodec.scatter_rows`), where its tokens go indexed once
  for all the runs of a (group, piece); other pages one by one. Their payloads were checked on
  the host already.
* **CUDA** (:func:`write_on_device`, on the load thread; it runs on CPU tensors too, for the
  tests): slice by slice through two fixed device slots, each run is one copy to a device
  block, the payload checksums are computed there (:mod:`.device_checksum`) and the rows
  written into vLLM's blocks, all on the load stream after the compute stream's work at the
  load's start; the returned :class:`DeviceLoad` says, once complete, which pages were bad. A
  bad page was written too: the load then fails and vLLM recomputes into those blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from hybrid_offload.connector.metadata import ClearRange, PageJob
from hybrid_offload.connector.worker.device import DeviceTransfers, Ready
from hybrid_offload.connector.worker.device_checksum import fold64_rows
from hybrid_offload.connector.worker.page_codec import PageCodec, PiecePayload
from hybrid_offload.core.planner import Piece
from hybrid_offload.engine.kv_layout import AttentionGroupLayout, MambaGroupLayout, TokenIndex, host_to_device

Layout = AttentionGroupLayout | MambaGroupLayout

#: rows of pages start at multiples of this many bytes (any dtype's view is aligned)
ALIGN = 64


def row_width(page_len: int) -> int:
    """The distance of two pages side by side in staging rows or the arena."""
    return -(-page_len // ALIGN) * ALIGN


@dataclass(frozen=True)
class ShardRead:
    """One piece of a page to load: its backend key, this worker's codec for its group and the
    piece's page length (looked up once)."""

    page: PageJob
    piece: Piece
    key: str
    codec: PageCodec
    page_len: int = -1

    def __post_init__(self) -> None:
        if self.page_len < 0:
            object.__setattr__(self, "page_len", self.codec.page_lens[self.piece])


@dataclass
class Verified:
    """A page whose header is the one asked for: its bytes are ``base[offset:offset+page_len]``
    (``base`` a 1-D uint8 host tensor: a staging block, the arena, a buffer of its own);
    ``checksum`` is its stated payload checksum where the payload is still to be checked (on
    the device), None where it was checked; ``source`` the backend it came from."""

    read: ShardRead
    base: torch.Tensor
    offset: int
    source: str
    checksum: int | None = None

    def address(self) -> int:
        return self.base.data_ptr() + self.offset


@dataclass
class RowRun:
    """Pages of one (group, piece) side by side: ``rows`` is a ``(k, page_len)`` view with rows
    :func:`row_width` apart."""

    pages: list[Verified]
    rows: torch.Tensor


def side_by_side(places: Sequence[tuple[object, int]], width: int) -> list[range]:
    """The runs of ``places`` (per item, in this order: which memory (a key compared with
    ``==``) and the byte offset there): items ``width`` bytes apart in one memory, each run one
    copy or one numpy call instead of one per page."""
    runs, start = [], 0
    for i in range(1, len(places) + 1):
        if i == len(places) or places[i][0] != places[start][0] or \
                places[i][1] != places[start][1] + (i - start) * width:  # fmt: skip
            runs.append(range(start, i))
            start = i
    return runs


def runs_of(pages: Sequence[Verified]) -> list[RowRun]:
    """``pages`` (one (group, piece)) by address, cut into runs side by side in one memory."""
    ordered = sorted(pages, key=Verified.address)
    if not ordered:
        return []
    plen = ordered[0].read.page_len
    runs = []
    for run in side_by_side([(id(v.base), v.offset) for v in ordered], row_width(plen)):
        first = ordered[run.start]
        base = first.base
        rows = base.as_strided((len(run), plen), (row_width(plen), 1), base.storage_offset() + first.offset)
        runs.append(RowRun(ordered[run.start : run.stop], rows))
    return runs


def _by_piece(pages: Iterable[Verified]) -> dict[tuple[int, Piece], list[Verified]]:
    out: dict[tuple[int, Piece], list[Verified]] = {}
    for v in pages:
        out.setdefault((v.read.page.group, v.read.piece), []).append(v)
    return out


@dataclass(frozen=True)
class RowBatch:
    """The runs of rows of one (group, piece) written as rows, and where the tokens of all
    their pages go (``at``: ``(pages, tokens)``, the runs' pages in order)."""

    codec: PageCodec
    group: int
    piece: Piece
    runs: list[tuple[torch.Tensor, list[PageJob]]]
    at: TokenIndex


@dataclass
class WritePlan:
    """A load's writes from host memory (CPU): batches of rows, and per group the pages
    written one by one (their payloads)."""

    batches: list[RowBatch]
    loose: dict[int, list[PiecePayload]]
    codecs: dict[int, PageCodec]


def plan_writes(pages: Iterable[Verified], layouts: Mapping[int, Layout]) -> WritePlan:
    """Sort a load's checked pages into batches of rows and loose pages (any thread)."""
    plan = WritePlan([], {}, {})
    for (group, piece), items in _by_piece(pages).items():
        codec = items[0].read.codec
        plan.codecs[group] = codec
        hlen = codec.header_lens[piece]
        whole = [v for v in items if not v.read.page.skip_tokens]
        runs = []
        for run in runs_of(whole):
            jobs = [v.read.page for v in run.pages]
            if codec.rows_fit(layouts[group], piece, run.rows, jobs):
                runs.append((run.rows, jobs))
            else:
                loose = plan.loose.setdefault(group, [])
                loose.extend(PiecePayload(job, piece, row[hlen:])
                             for job, row in zip(jobs, run.rows, strict=True))  # fmt: skip
        if runs:
            at = codec.row_index(layouts[group], piece, [job for _, jobs in runs for job in jobs])
            plan.batches.append(RowBatch(codec, group, piece, runs, at))
        for v in items:
            if v.read.page.skip_tokens:
                row = v.base[v.offset + hlen : v.offset + v.read.page_len]
                plan.loose.setdefault(group, []).append(PiecePayload(v.read.page, piece, row))
    return plan


def write_pages(plan: WritePlan, layouts: Mapping[int, Layout]) -> None:
    """Write a planned load into vLLM's KV cache from host memory (CPU engines)."""
    for batch in plan.batches:
        batch.codec.scatter_runs(layouts[batch.group], batch.piece, batch.runs, batch.at)
    for group, items in plan.loose.items():
        plan.codecs[group].scatter_pages(layouts[group], items)


def clear_ranges(clears: Iterable[ClearRange], layouts: Mapping[int, Layout]) -> None:
    """Zero the parts of a load's last attention blocks that it did not fill."""
    for clear in clears:
        layout = layouts.get(clear.group)
        if layout is None:
            continue  # a pipeline stage holding no layer of this group
        assert isinstance(layout, AttentionGroupLayout)
        layout.zero(layout.token_index([clear.block_id], clear.first_token, clear.num_tokens))


#: bytes of each of the two device slots a load's pages pass through on a GPU (device memory of
#: loads: two slots, whatever the load's length; a page larger than a slot gets slots its size)
SLOT_BYTES = 128 << 20


class DeviceMarks(NamedTuple):
    """A load's device timing events (CUDA; None on CPU): first copy's start, last copy's end, the end."""

    start: torch.cuda.Event | None
    copied: torch.cuda.Event | None
    end: torch.cuda.Event | None


@dataclass
class DeviceLoad:
    """A load enqueued on the device: complete once ``ready`` is; then ``bad`` (host) holds,
    per page in ``pages``' order, whether its payload failed the checksum, and the timing
    events (CUDA) say how long the copies and the whole device part took."""

    ready: Ready
    pages: list[Verified]
    bad: torch.Tensor
    #: device memory the enqueued work reads (kept alive until it completes)
    keep: list[torch.Tensor] = field(default_factory=list)
    marks: DeviceMarks | None = None

    def wait(self) -> list[Verified]:
        """Block until complete (the GIL released); the pages that failed their checksum."""
        self.ready.wait()
        return [v for v, b in zip(self.pages, self.bad.tolist(), strict=True) if b]

    def seconds(self) -> tuple[float, float]:
        """(first copy's start to last copy's end, first copy's start to the end), once complete;
        zeros on CPU."""
        marks = self.marks
        if marks is None or marks.start is None or marks.copied is None or marks.end is None:
            return 0.0, 0.0
        return marks.start.elapsed_time(marks.copied) / 1e3, marks.start.elapsed_time(marks.end) / 1e3


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


class SlotSlice(NamedTuple):
    """Pages of one (group, piece) of a load that pass through a device slot together."""

    group: int
    piece: Piece
    codec: PageCodec
    pages: list[Verified]


def _slices(pages: Sequence[Verified], slot_bytes: int) -> list[SlotSlice]:
    """A load's pages per (group, piece), ordered by runs (pages that skip tokens last), cut
    into slices of at most ``slot_bytes`` of rows (at least one page)."""
    out: list[SlotSlice] = []
    for (group, piece), items in _by_piece(pages).items():
        codec = items[0].read.codec
        placed = [v for skip in (False, True)
                  for run in runs_of([v for v in items if bool(v.read.page.skip_tokens) == skip])
                  for v in run.pages]  # fmt: skip
        per = max(1, slot_bytes // row_width(codec.page_lens[piece]))
        out.extend(SlotSlice(group, piece, codec, placed[i : i + per]) for i in range(0, len(placed), per))
    return out


def _copy_in(slot: torch.Tensor, pages: Sequence[Verified], width: int, plen: int) -> None:
    """``pages`` into consecutive rows of ``slot``: one copy per run of pages side by side."""
    for run in side_by_side([(id(v.base), v.offset) for v in pages], width):
        first, span = pages[run.start], (len(run) - 1) * width + plen
        src = first.base.as_strided((span,), (1,), first.base.storage_offset() + first.offset)
        slot[run.start * width : run.start * width + span].copy_(src, non_blocking=True)


def write_on_device(
    pages: Sequence[Verified], layouts: Mapping[int, Layout], clears: Iterable[ClearRange],
    transfers: DeviceTransfers, after: torch.cuda.Event | None, slot_bytes: int = SLOT_BYTES,
) -> DeviceLoad:  # fmt: skip
    """Enqueue a load on the device (load thread, CUDA; on CPU tensors it runs in place of the
    device, for the tests). Slice by slice (:func:`_slices`), alternating between two slots:
    the copy stream copies a slice's runs into its slot once the slot's last slice was
    written; the load stream checks the slice's payloads and writes its rows into vLLM's
    blocks once they arrived, after ``after`` (the step's mark), so copies overlap the writes.
    Then the clears."""
    slices = _slices(pages, slot_bytes)
    need = max((len(sl.pages) * row_width(sl.codec.page_lens[sl.piece]) for sl in slices), default=0)
    slots = transfers.load_slots(need)
    order: list[Verified] = []
    flags: list[torch.Tensor] = []
    free: list[torch.cuda.Event | None] = [None, None]
    device = transfers.device
    with transfers.loading(after):
        start = transfers.event(timing=True)
        copied = None
        for s, sl in enumerate(slices):
            codec, piece, batch = sl.codec, sl.piece, sl.pages
            plen, hlen = codec.page_lens[piece], codec.header_lens[piece]
            width, slot = row_width(plen), slots[s % 2]
            with transfers.copying(free[s % 2] or start):
                _copy_in(slot, batch, width, plen)
                copied = transfers.event(timing=True)
            transfers.after(copied)
            rows = slot[: len(batch) * width].view(len(batch), width)[:, :plen]
            flags.append(_check(rows[:, hlen:], batch, device))
            jobs = [v.read.page for v in batch]
            whole = sum(not job.skip_tokens for job in jobs)
            layout = layouts[sl.group]
            loose = range(whole, len(batch)) if whole and codec.scatter_rows(
                layout, piece, rows[:whole], jobs[:whole]) else range(len(batch))  # fmt: skip
            if loose:
                codec.scatter_pages(layout, [PiecePayload(jobs[i], piece, rows[i, hlen:]) for i in loose])
            free[s % 2] = transfers.event()
            order.extend(batch)
        clear_ranges(clears, layouts)
        bad_device = torch.cat(flags) if flags else torch.zeros(0, dtype=torch.bool, device=device)
        bad = torch.empty(bad_device.shape, dtype=torch.bool, pin_memory=transfers.is_cuda)
        bad.copy_(bad_device, non_blocking=True)
        end = transfers.event(timing=True)
        ready = transfers.loaded()
    return DeviceLoad(ready, order, bad, [bad_device], DeviceMarks(start, copied, end))


def _check(payloads: torch.Tensor, pages: Sequence[Verified], device: torch.device) -> torch.Tensor:
    """Per row of ``payloads`` (device), whether it fails the checksum its page states (False
    for pages checked already); enqueued."""
    if all(v.checksum is None for v in pages):
        return torch.zeros(len(pages), dtype=torch.bool, device=device)
    want = host_to_device(torch.tensor([_signed(v.checksum or 0) for v in pages], dtype=torch.int64), device)
    checked = host_to_device(torch.tensor([v.checksum is not None for v in pages], dtype=torch.bool), device)
    return (fold64_rows(payloads) != want) & checked
