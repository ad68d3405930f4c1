"""The worker's store pipeline: copy a step's pages out of vLLM's KV cache, seal and put them.

Worker side. The model-runner thread calls :meth:`StorePipeline.copy_out` in ``wait_for_save``
(after the forward): the only synchronous work is copying this step's completed chunks and
boundary states out of the KV cache into page buffers (on a GPU: enqueuing the gathers and the
copy to pinned memory, see :mod:`.device`). Pages the scheduler cannot key yet are *held* (kept
by request, group and chunk) until a commit names their key, or dropped when their request is
released. Sealing (checksums) and backend puts run on the store thread, which reports every page
set it finished (``settled``) so that lookups waiting for it go on. Promotions
(:meth:`StorePipeline.promote`: pages a load read and checked, for faster tiers) are put there
too, within the same pending-bytes budget.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hybrid_offload.backends.base import BackendError, Buffer, BuffersInUseError, PageReservation
from hybrid_offload.backends.retention import Retention
from hybrid_offload.connector.metadata import CommitJob, StoreJob, TouchJob
from hybrid_offload.connector.worker.context import WorkerContext
from hybrid_offload.connector.worker.device import DeviceTransfers, Ready
from hybrid_offload.connector.worker.held import HeldCopies, HeldPiece, HoldKey
from hybrid_offload.connector.worker.load_writes import row_width
from hybrid_offload.connector.worker.memory_pool import STORE_POOL_BYTES
from hybrid_offload.connector.worker.staging import (
    GatheredRow,
    GatheredRows,
    StorePiece,
    copy_rows,
    device_sums,
    gather_on_device,
    gather_on_host,
    gather_rows,
)
from hybrid_offload.core.checksum import fold64
from hybrid_offload.core.page_format import seal_headers, seal_page

logger = logging.getLogger(__name__)

_STOP = object()

class PagePut(NamedTuple):
    """A page about to be put: its key, the tiers it goes to and its retention (None: not given)."""

    key: str
    backends: Sequence[str]
    retention: Retention | None


class PromotedPage(NamedTuple):
    """A sealed page a load read and checked: its key, its bytes, the tiers to put it into, its retention."""

    key: str
    buffer: memoryview
    backends: tuple[str, ...]
    retention: Retention | None


@dataclass
class PromotedPages:
    """Sealed pages a load read and checked, to put into faster tiers; ``release`` gives their
    memory back once put."""

    pages: list[PromotedPage]
    release: Callable[[], None]


class QueuedBatch(NamedTuple):
    """Pieces for the store thread, the blocks holding their buffers, and when copies into them are done."""

    pieces: list[StorePiece]
    #: the memory of the pieces' buffers, back to the pool once stored
    blocks: Sequence[torch.Tensor]
    #: complete once every copy out of the device enqueued before the batch is
    ready: Ready


class QueuedWork(NamedTuple):
    """An item of the store queue: its work and the pending bytes it counts until done."""

    work: GatheredRows | PromotedPages | QueuedBatch
    nbytes: int


class StorePipeline:
    """Copies out (model-runner thread), holds, commits, and the store thread."""

    def __init__(self, ctx: WorkerContext, max_pending_store_bytes: int, max_held_bytes: int) -> None:
        self.ctx = ctx
        self._max_pending = max_pending_store_bytes
        self._max_held = max_held_bytes
        self._pending_bytes = 0
        self._held = HeldCopies()
        self._lock = threading.Lock()
        self._namespace_checked = False
        self._store_queue: queue.Queue = queue.Queue()
        self._arenas: dict[int, torch.Tensor] = {}
        self.use_device(ctx.transfers)
        self._store_thread = threading.Thread(
            target=self._store_loop, name="hybrid-offload-store", daemon=True
        )
        self._store_thread.start()

    def use_device(self, transfers: DeviceTransfers) -> None:
        """Host rows for ``transfers.device`` (pinned where it has them)."""
        self.store_rows = transfers.host_pool(STORE_POOL_BYTES)
        self._hold_rows = transfers.host_pool(0)  # held copies are kept outside the pool

    def release(self, req_id: str) -> None:
        """Drop what a released request still holds."""
        self._held.release(req_id)

    def touch(self, job: TouchJob) -> None:
        """Queue a recency refresh (after the puts queued before it)."""
        self._store_queue.put(job)

    def copy_out(self, stores: list[StoreJob]) -> None:
        """Copy this step's pages (this rank's pieces of them) out of the KV cache: stores are
        queued for the store thread, holds kept until committed (timed: ``copy_out_seconds``)."""
        stores = [job for job in stores if self.ctx.codecs[job.page.group].written]  # others: not ours
        if not stores or not self.ctx.layouts:
            self.ctx.outbox.settle([job.page.key for job in stores if not job.hold])
            return
        started = self.ctx.timer()
        queued: list[StoreJob] = []
        nbytes = 0
        for job in stores:
            codec = self.ctx.codecs[job.page.group]
            size = sum(codec.page_lens[p] for p in codec.written)
            if not self._admit(job, size, nbytes):
                continue
            if job.hold:  # kept for steps: rows of a block of its own, not from the pool
                page = job.page
                entries, _ = gather_rows([job], self.ctx.codecs, self.ctx.layouts, self._hold_rows,
                                         self.ctx.transfers)  # fmt: skip
                pieces = [HeldPiece(entry.piece, entry.buffer) for entry in entries]
                newest_only = not codec.group.is_attention  # the newest state replaces older ones
                key = HoldKey(job.req_id, page.group, page.chunk_index)
                self._held.hold(key, pieces, newest_only=newest_only)
            else:
                queued.append(job)
                nbytes += size
        if queued:
            codecs, layouts = self.ctx.codecs, self.ctx.layouts
            cuda = self.ctx.transfers.device_path
            gathered = (gather_on_device(queued, codecs, layouts, self.ctx.transfers) if cuda
                        else gather_on_host(queued, codecs, layouts, self.store_rows))  # fmt: skip
            if gathered is not None:
                self._queue_item(gathered, nbytes, gathered.count)
        elapsed = self.ctx.timer() - started
        self.ctx.stats.add(copy_out_seconds=elapsed)

    def _admit(self, job: StoreJob, size: int, queued: int) -> bool:
        """Whether the pending-bytes budget (for holds: the held-bytes budget) takes ``size``
        more bytes; a dropped store is counted and settled."""
        with self._lock:
            used = self._held.nbytes if job.hold else self._pending_bytes + queued
            if used + size <= (self._max_held if job.hold else self._max_pending):
                return True
        self.ctx.stats.add(stores_dropped=1)
        if not job.hold:
            self.ctx.outbox.settle([job.page.key])
        return False

    def promote(self, work: PromotedPages) -> None:
        """Queue ``work`` for the store thread (any thread may call it); past the pending-bytes
        budget it is dropped (``promotions_dropped``) and its memory given back at once."""
        nbytes = sum(page.buffer.nbytes for page in work.pages)
        with self._lock:
            admitted = bool(work.pages) and self._pending_bytes + nbytes <= self._max_pending
            if admitted:
                self._pending_bytes += nbytes
        if admitted:
            self._store_queue.put(QueuedWork(work, nbytes))
            return
        self.ctx.stats.add(promotions_dropped=len(work.pages))
        work.release()

    def commit(self, commits: list[CommitJob]) -> None:
        """Queue held pages under the keys the scheduler knows now (a page no longer held,
        e.g. dropped for the budget, is settled as it is)."""
        batch: list[StorePiece] = []
        nbytes = 0
        for commit in commits:
            if not self.ctx.codecs[commit.page.group].written:
                continue  # a group this worker writes no piece of (another stage's layers)
            pieces = self._held.take(HoldKey(commit.req_id, commit.page.group, commit.page.chunk_index))
            if pieces is None:
                self.ctx.outbox.settle([commit.page.key])
                continue
            job = StoreJob(commit.page, commit.backends, commit.req_id, retention=commit.retention)
            batch.extend(StorePiece(job, held.piece, held.buffer) for held in pieces)
            nbytes += sum(len(held.buffer) for held in pieces)
        self._queue(batch, nbytes)

    def _queue(self, batch: list[StorePiece], nbytes: int, blocks: Sequence[torch.Tensor] = ()) -> None:
        """Queue ``batch``; ``blocks`` (its buffers' memory) go back to the pool once stored. The
        store thread starts on it once every copy out of the device enqueued so far is done."""
        if batch:
            self._queue_item(QueuedBatch(batch, blocks, self.ctx.transfers.stored()), nbytes, len(batch))

    def _queue_item(self, item: GatheredRows | QueuedBatch, nbytes: int, npages: int) -> None:
        with self._lock:
            self._pending_bytes += nbytes
        self._store_queue.put(QueuedWork(item, nbytes))
        self.ctx.stats.add(pages_copied_out=npages, bytes_copied_out=nbytes)

    def _store_loop(self) -> None:
        while True:
            item = self._store_queue.get()
            if item is _STOP:
                self._store_queue.task_done()  # or a later flush() would wait for it forever
                return
            if isinstance(item, TouchJob):
                try:
                    self._touch(item)
                except Exception:  # the store thread must survive anything a backend does
                    logger.exception("hybrid-offload touch failed")
                finally:
                    self._store_queue.task_done()
                continue
            work, nbytes = item.work, item.nbytes
            keys: list[str] = []
            try:
                if isinstance(work, GatheredRows):
                    keys = [job.page.key for job in work.jobs]
                    self._store_rows(work)
                elif isinstance(work, PromotedPages):
                    try:
                        self._put_promoted(work)
                    finally:
                        work.release()
                else:
                    keys = [queued.job.page.key for queued in work.pieces]
                    work.ready.wait()
                    if self._store_batch(work.pieces):
                        for block in work.blocks:
                            self.store_rows.give(block)  # put_batch copied what it keeps
            except Exception:  # the store thread must survive anything a backend does
                logger.exception("hybrid-offload store batch failed")
                self.ctx.stats.add(store_batch_errors=1)
            finally:
                with self._lock:
                    self._pending_bytes -= nbytes
                self.ctx.outbox.settle(list(dict.fromkeys(keys)))
                self._store_queue.task_done()

    def _check_namespace(self, key: str) -> None:
        """Once: the scheduler's keys must carry this worker's fingerprint, or pages stored now
        would never be found by an engine whose scheduler agrees with its workers."""
        if self._namespace_checked:
            return
        self._namespace_checked = True
        if not key.startswith(self.ctx.spec.fingerprint + "-"):
            logger.error(
                "hybrid-offload: the scheduler keys pages under %s but this worker's model "
                "fingerprint is %s; pages stored now are not shared with other engines",
                key.partition("-")[0],
                self.ctx.spec.fingerprint,
            )

    def _store_batch(self, batch: list[StorePiece]) -> bool:
        """Seal and put ``batch``; whether its buffers may be reused (False: a backend could not
        stop a transfer reading them, :class:`BuffersInUseError`: they are retired)."""
        reusable = True
        per_backend: dict[str, list[tuple[str, Buffer]]] = {}
        if batch:
            self._check_namespace(batch[0].job.page.key)
        # Deepest page first: a backend's LRU then keeps a prefix more recent than the pages
        # that need it (a state needs every chunk before it), and evicts from the deep end.
        keyed = []
        for job, piece, buf in reversed(batch):
            seal_page(buf, self.ctx.codecs[job.page.group].header(job.page, piece), self.ctx.page_key)
            key = self.ctx.planner.piece_key(job.page.key, job.page.group, piece)
            keyed.append((key, job))
            for name in job.backends:
                per_backend.setdefault(name, []).append((key, buf))
        self._describe([PagePut(key, job.backends, job.retention) for key, job in keyed])
        for name, items in per_backend.items():
            try:
                results = self.ctx.backends[name].put_batch(items)
            except BackendError as exc:
                reusable = reusable and not isinstance(exc, BuffersInUseError)
                self.ctx.stats.add_backend(name, store_failures=len(items))
                continue
            self._record_puts(name, items, results)
        return reusable

    def _record_puts(self, name: str, items: Sequence[tuple[str, Buffer]], ok: Sequence[bool]) -> int:
        """Report the pages of one ``put_batch`` that tier ``name`` stored (the outbox, the
        counters); how many it stored."""
        stored = [(key, buf) for (key, buf), o in zip(items, ok, strict=True) if o]
        self.ctx.outbox.add_stored(name, [key for key, _ in stored])
        stored_bytes = sum(memoryview(buf).nbytes for _, buf in stored)
        self.ctx.stats.add_backend(
            name, stored_pages=len(stored), stored_bytes=stored_bytes, store_failures=len(items) - len(stored)
        )
        return len(stored)

    def _store_rows(self, rows: GatheredRows) -> None:
        """Store thread: a step's gathered rows to their tiers. Each page's first tier that
        keeps pages in place (the cpu arena) reserves its extents (side by side per (group,
        piece), so that the rows go in one copy per run: from the GPU straight into the arena,
        on the host with numpy); other pages stay in the gathered block (host) or go to pooled
        pinned rows (GPU). Sealed with the checksums computed on the device (GPU) or here
        without the GIL (CPU), a few numpy calls per (group, piece); the reservations are
        committed and the other tiers put to, deepest page first."""
        entries = list(rows.rows())
        codecs, backends = self.ctx.codecs, self.ctx.backends
        keys = [self.ctx.planner.piece_key(entry.job.page.key, entry.job.page.group, entry.place.piece)
                for entry in entries]  # fmt: skip
        plens = [codecs[entry.place.group].page_lens[entry.place.piece] for entry in entries]
        self._check_namespace(entries[0].job.page.key)
        self._describe([PagePut(key, entry.job.backends, entry.job.retention)
                        for key, entry in zip(keys, entries, strict=True)])  # fmt: skip
        home = [next((n for n in entry.job.backends if backends[n].in_place), None) for entry in entries]
        dest: list[tuple[torch.Tensor, int] | None] = [None] * len(entries)
        reservations: dict[str, tuple[PageReservation, list[int]]] = {}
        for name in dict.fromkeys(h for h in home if h is not None):
            idx = [i for i, h in enumerate(home) if h == name]
            try:
                res = backends[name].reserve_batch([keys[i] for i in idx], [plens[i] for i in idx])
            except BackendError:
                continue
            reservations[name] = (res, idx)
            for i, view, offset in zip(idx, res.views, res.offsets, strict=True):
                if view is not None and res.memory is not None and offset is not None:
                    dest[i] = (self._arena(res.memory), offset)
        on_device = self.ctx.transfers.device_path
        spill: torch.Tensor | None = None
        if on_device and any(d is None for d in dest):
            spill = self.store_rows.take(sum(row_width(plens[i]) for i, d in enumerate(dest) if d is None))
        at = 0
        for i, entry in enumerate(entries):
            if dest[i] is None and spill is not None:
                dest[i], at = (spill, at), at + row_width(plens[i])
            elif dest[i] is None:
                dest[i] = (rows.block, entry.place.offset + entry.row * entry.place.width)
        placed: list[tuple[torch.Tensor, int]] = dest  # type: ignore[assignment]
        if on_device:
            with self.ctx.transfers.storing(after_compute=False):
                on_gpu = device_sums(rows, codecs)  # after the gather (its event)
                copy_rows(rows, entries, placed, plens)
                sums = torch.empty(on_gpu.shape, dtype=torch.int64, pin_memory=self.ctx.transfers.is_cuda)
                sums.copy_(on_gpu, non_blocking=True)
                done = self.ctx.transfers.stored()
            done.wait()
            stated: list[int] = sums.tolist()
        else:
            copy_rows(rows, entries, placed, plens)
            stated = []
        views = [base.numpy()[off : off + n].data
                 for (base, off), n in zip(placed, plens, strict=True)]  # fmt: skip
        self._seal(entries, views, stated)
        stored: dict[str, list[int]] = {}
        rank = {i: r for r, i in enumerate(self._deepest_first(entries))}
        for name, (res, idx) in reservations.items():
            order = sorted(range(len(idx)), key=lambda j: rank[idx[j]])
            ok = res.commit(order=order)  # deepest first: the prefix ends most recent
            stored[name] = [idx[j] for j in order if ok[j]]
        reusable = self._put_rows(entries, keys, views, home, stored)
        for block in (spill, None if on_device else rows.block):
            if block is not None and reusable:
                self.store_rows.give(block)

    def _put_promoted(self, work: PromotedPages) -> None:
        """Store thread: put promoted pages (sealed already) into their tiers, deepest first as
        the load read them, and report what each stored."""
        self._describe([PagePut(page.key, page.backends, page.retention) for page in work.pages])
        per_backend: dict[str, list[tuple[str, memoryview]]] = {}
        for page in work.pages:
            for name in page.backends:
                per_backend.setdefault(name, []).append((page.key, page.buffer))
        for name, items in per_backend.items():
            try:
                ok = self.ctx.backends[name].put_batch(items)
            except BackendError:  # counted by the tier's wrappers; a promotion is best effort
                ok = [False] * len(items)
            promoted = self._record_puts(name, items, ok)
            self.ctx.stats.add(pages_promoted=promoted)

    def _describe(self, pages: Sequence[PagePut]) -> None:
        """Tell each target tier what the pages about to be put are for; a tier that cannot
        take them keeps its own order (never fails a store)."""
        per_backend: dict[str, list[tuple[str, Retention]]] = {}
        for put in pages:
            if put.retention is not None:
                for name in put.backends:
                    per_backend.setdefault(name, []).append((put.key, put.retention))
        for name, hints in per_backend.items():
            try:
                self.ctx.backends[name].describe_batch(hints)
            except BackendError as exc:
                logger.debug("%s: retention hints not taken: %s", name, exc)

    def _deepest_first(self, entries: Sequence[GatheredRow]) -> list[int]:
        """The order pages go to a tier: the step's jobs last to first (deepest first, a chunk's
        state before its attention), each job's pieces last to first."""
        def at(i: int) -> tuple[int, int]:
            place = entries[i].place
            return -place.jobs[entries[i].row], -self.ctx.codecs[place.group].written.index(place.piece)

        return sorted(range(len(entries)), key=at)

    def _seal(self, entries: Sequence[GatheredRow], views: list[memoryview], stated: list[int]) -> None:
        """Write the headers of ``entries``' pages (their payloads in ``views``), per (group,
        piece) at once; ``stated``: the payload checksums from the device (else computed)."""
        by_place: dict[int, list[int]] = {}
        for i, entry in enumerate(entries):
            by_place.setdefault(id(entry.place), []).append(i)
        for idx in by_place.values():
            place = entries[idx[0]].place
            codec = self.ctx.codecs[place.group]
            hlen = codec.header_lens[place.piece]
            payloads = [views[i][hlen:] for i in idx]
            sums = [stated[entries[i].position] for i in idx] if stated else [fold64(p) for p in payloads]
            pages = [entries[i].job.page for i in idx]
            hashes, indices = [p.chunk_hash for p in pages], [p.chunk_index for p in pages]
            template = codec.template(place.piece)
            heads = seal_headers(template, hashes, indices, sums, payloads, self.ctx.page_key)
            for i, head in zip(idx, heads, strict=True):
                views[i][:hlen] = head.data

    def _put_rows(self, entries: Sequence[GatheredRow], keys: list[str], views: list[memoryview],
                  home: list[str | None], stored: dict[str, list[int]]) -> bool:  # fmt: skip
        """Put sealed rows to every target tier but the one they are reserved in, deepest page
        first, and report what each tier stored; whether the rows' memory may be reused."""
        per_backend: dict[str, list[int]] = {}
        for i in self._deepest_first(entries):
            for name in entries[i].job.backends:
                if name != home[i] or name not in stored:  # not reserved there, or that failed
                    per_backend.setdefault(name, []).append(i)
        reusable = True
        for name, idx in per_backend.items():
            try:
                ok = self.ctx.backends[name].put_batch([(keys[i], views[i]) for i in idx])
            except BackendError as exc:
                reusable = reusable and not isinstance(exc, BuffersInUseError)
                ok = [False] * len(idx)
            stored.setdefault(name, []).extend(i for i, o in zip(idx, ok, strict=True) if o)
        for name, idx in stored.items():
            self.ctx.outbox.add_stored(name, [keys[i] for i in idx])
            targeted = sum(1 for entry in entries if name in entry.job.backends)
            stored_bytes = sum(views[i].nbytes for i in idx)
            self.ctx.stats.add_backend(
                name, stored_pages=len(idx), stored_bytes=stored_bytes, store_failures=targeted - len(idx)
            )
        return reusable

    def _arena(self, memory: memoryview) -> torch.Tensor:
        known = self._arenas.get(id(memory.obj))
        if known is None:
            known = self._arenas[id(memory.obj)] = torch.frombuffer(memory, dtype=torch.uint8)
        return known

    def _touch(self, job: TouchJob) -> None:
        """Store thread: refresh this rank's pieces of ``job.pages`` in order."""
        keys = [
            self.ctx.planner.piece_key(key, group, piece)
            for key, group in job.pages
            for piece in self.ctx.codecs[group].written
        ]
        for name in job.backends:
            backend = self.ctx.backends.get(name)
            if backend is None or not backend.touch_refreshes or not keys:
                continue
            try:
                backend.touch_batch(keys)
            except BackendError:
                continue  # counted by the tier's wrappers; recency is best effort

    def flush(self, timeout: float | None = None) -> None:
        """Wait until queued stores are written (used at shutdown and by tests)."""
        done = threading.Event()

        def drained() -> None:
            self._store_queue.join()
            done.set()

        threading.Thread(target=drained, daemon=True).start()
        done.wait(timeout)

    @property
    def running(self) -> bool:
        """Whether the store thread runs (until :meth:`shutdown`)."""
        return self._store_thread.is_alive()

    def shutdown(self, timeout: float) -> None:
        if self._store_thread.is_alive():  # idempotent: a second call must not wait on the queue
            self.flush(timeout)
            self._store_queue.put(_STOP)
            self._store_thread.join(timeout)
