"""The worker's load pipeline: read and check pages on the load thread, write them into vLLM's
KV cache.

Worker side. :meth:`LoadPipeline.start` hands load jobs to the load thread, which takes each
page from its backend (in place from the cpu tier's arena,
:meth:`~hybrid_offload.backends.base.Backend.lease_batch`; into staging rows from the others,
``get_into``), checks its header (a few numpy calls for all pages,
:func:`~hybrid_offload.core.page_format.check_headers`) and its payload, and plans the writes
(:mod:`.load_writes`). Where the payload is checked depends on the device:

* **CPU engines**: on the load thread (fold64 in numpy, without the GIL); the writes run on the
  model-runner thread in :meth:`LoadPipeline.write_finished`, straight from where the pages are
  (torch work on the load thread competes with the forward's OpenMP threads and measured ~10x
  slower).
* **CUDA engines**: the load thread copies the pages to the device, checks them there and
  writes them into vLLM's blocks on the load stream, after the work the compute stream held
  when the load started, and waits for it; the model-runner thread only reports the load.
* Pages signed under the cache's secret are checked against their MAC on the host, except
  pages lent by the cpu tier (memory no other process can write: its checksum suffices).

A backend error or a bad page never raises into vLLM: the page is a miss (a page that fails
its header or host check is read from the next backend in the fallback order), the load fails
as a whole, and vLLM recomputes the request.

Once a load is written, the pages its job names for promotion (``LoadJob.promotions``) go to
the store thread (``promote``) with the memory they were read into, which it gives back after
the puts; a failed load promotes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from hybrid_offload.backends.base import Backend, BackendError, PageLease
from hybrid_offload.backends.wrappers import BackendSkippedError
from hybrid_offload.connector.metadata import ClearRange, LoadJob, Promotion
from hybrid_offload.connector.worker.context import WorkerContext
from hybrid_offload.connector.worker.device import DeviceTransfers
from hybrid_offload.connector.worker.load_writes import (
    ShardRead,
    Verified,
    WritePlan,
    clear_ranges,
    plan_writes,
    row_width,
    side_by_side,
    write_on_device,
    write_pages,
)
from hybrid_offload.connector.worker.page_codec import PageCodec
from hybrid_offload.connector.worker.staging import stage_reads
from hybrid_offload.connector.worker.store_pipeline import PromotedPage, PromotedPages
from hybrid_offload.connector.worker.switch_interval import LoadSwitchInterval
from hybrid_offload.core.checksum import fold64, fold64_rows
from hybrid_offload.core.layer_parts import LayerPartError
from hybrid_offload.core.page_format import (
    ForeignLayersError,
    PageFormatError,
    check_header,
    check_headers,
    check_mac,
)
from hybrid_offload.core.planner import Piece

logger = logging.getLogger(__name__)


class HostMemory(NamedTuple):
    """One host memory as a 1-D uint8 tensor and a numpy array over the same bytes."""

    tensor: torch.Tensor
    array: np.ndarray


class FoundPage(NamedTuple):
    """A page a backend gave: ``size`` bytes at ``offset`` in ``base`` (``array``: the same memory)."""

    base: torch.Tensor
    array: np.ndarray
    offset: int
    size: int


@dataclass
class LoadRun:
    """What the load thread made of one job: its checked pages (None: the load failed) and its
    timings (``timer`` seconds; read and verify summed over backends)."""

    pages: list[Verified] | None = None
    submitted: float = 0.0
    started: float = 0.0
    finished: float = 0.0
    read_s: float = 0.0
    verify_s: float = 0.0
    #: CUDA: from the device work's enqueue to its completion (the load thread waits for it)
    device_s: float = 0.0
    #: the staging memory of the load, and whether a failed read may still write into it
    staging: torch.Tensor | None = None
    tainted: bool = False
    #: pages lent in place, released once nothing reads them
    leases: list[PageLease] = field(default_factory=list)
    #: CPU: the writes, planned on the load thread, for the model-runner thread
    plan: WritePlan | None = None
    #: CUDA: written into vLLM's blocks by the load thread (complete)
    written: bool = False
    #: the job's pages to put into faster tiers once the load is written
    promotions: tuple[Promotion, ...] = ()


def _headers(found: Sequence[FoundPage], hlen: int) -> np.ndarray:
    """The first ``hlen`` bytes of each page found, ``(n, hlen)``: one numpy gather per memory."""
    heads = np.empty((len(found), hlen), dtype=np.uint8)
    by_memory: dict[int, list[int]] = {}
    for i, f in enumerate(found):
        by_memory.setdefault(id(f.array), []).append(i)
    span = np.arange(hlen)
    for rows in by_memory.values():
        array = found[rows[0]].array
        offsets = np.fromiter((found[i].offset for i in rows), dtype=np.int64, count=len(rows))
        heads[rows] = array[offsets[:, None] + span]
    return heads


def _payload_sums(found: Sequence[FoundPage], hlen: int) -> list[int]:
    """fold64 of each page's payload (the pages of one piece, all ``found[0].size`` bytes): one
    numpy call per run of pages side by side in one memory (few handoffs of the GIL, which
    numpy releases while it sums), per page elsewhere."""
    out = [0] * len(found)
    order = sorted(range(len(found)), key=lambda i: (id(found[i].array), found[i].offset))
    size = found[0].size if found else 0
    width = row_width(size)
    for run in side_by_side([(id(found[i].array), found[i].offset) for i in order], width):
        first, members = found[order[run.start]], [order[r] for r in run]
        if len(run) > 1 and width % 8 == 0 and (first.offset + hlen) % 8 == 0:
            rows = np.lib.stride_tricks.as_strided(first.array[first.offset :], (len(run), size), (width, 1))
            for i, value in zip(members, fold64_rows(rows[:, hlen:]).tolist(), strict=True):
                out[i] = value
        else:
            for i in members:
                f = found[i]
                out[i] = fold64(f.array[f.offset + hlen : f.offset + f.size].data)
    return out


class LoadPipeline:
    """The load thread and the writes of finished loads."""

    def __init__(
        self,
        ctx: WorkerContext,
        staging_pool_bytes: int,
        switch_interval_s: float,
        promote: Callable[[PromotedPages], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self._promote = promote
        self._staging_pool_bytes = staging_pool_bytes
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="hybrid-offload-load")
        self._loads: dict[str, Future] = {}
        self._clears: dict[str, tuple[ClearRange, ...]] = {}
        self._preempted: set[str] = set()
        self.switch = LoadSwitchInterval(switch_interval_s)
        self._lock = threading.Lock()
        self._bad_page_logged: set[str] = set()
        self._arenas: dict[int, HostMemory] = {}
        self.use_device(ctx.transfers)

    def use_device(self, transfers: DeviceTransfers) -> None:
        """Staging memory for ``transfers.device`` (pinned where it has them)."""
        self.staging = transfers.host_pool(self._staging_pool_bytes)

    def in_flight(self, req_id: str) -> Future | None:
        """The load thread's future of ``req_id``'s load, if one is in flight."""
        return self._loads.get(req_id)

    def start(self, loads: list[LoadJob]) -> None:
        after = self.ctx.transfers.mark() if loads else None
        for job in loads:
            self._loads[job.req_id] = self._loader.submit(self._load, job, self.ctx.timer(), after)
            self._clears[job.req_id] = job.clears
        self.switch.loading(bool(self._loads))

    def _load(self, job: LoadJob, submitted: float, after: torch.cuda.Event | None) -> LoadRun:
        """Load thread: take and check this rank's pieces of every page of a job (pages None
        if any is unusable), then write them on a GPU or plan the writes on a CPU, timed."""
        run = LoadRun(submitted=submitted, started=self.ctx.timer(), promotions=job.promotions)
        try:
            run.pages = self._load_pages(job, run)
            if run.pages is not None and self.ctx.transfers.device_path:
                self._write_on_device(job, run, after)
            elif run.pages is not None:
                run.plan = plan_writes(run.pages, self.ctx.layouts)
        except Exception:
            logger.exception("hybrid-offload load of request %s failed", job.req_id)
            run.pages = None
            if self.ctx.transfers.device_path:
                self.ctx.transfers.drain_loads()  # nothing of it may still write into the blocks
        if run.pages is None or run.written:
            self._done_with(run, written=run.written and run.pages is not None)
        run.finished = self.ctx.timer()
        return run

    def _write_on_device(self, job: LoadJob, run: LoadRun, after: torch.cuda.Event | None) -> None:
        assert run.pages is not None
        started = self.ctx.timer()
        device_load = write_on_device(run.pages, self.ctx.layouts, job.clears, self.ctx.transfers, after)
        bad = device_load.wait()
        run.device_s = self.ctx.timer() - started
        run.written = True
        copy_s, _ = device_load.seconds()
        self.ctx.stats.add(load_copy_seconds=copy_s)
        for page in bad:
            self._bad_page(page.source, page.read.key, PageFormatError("payload checksum mismatch (device)"))
        if bad:
            run.pages = None

    def _done_with(self, run: LoadRun, written: bool = False) -> None:
        """The load is over (``written``: into the KV cache): release its leases, promote its
        pages, give its staging back once nothing reads it (never where a failed read may
        still write into it)."""
        for lease in run.leases:
            lease.release()
        run.leases = []
        staging = run.staging if not run.tainted else None
        run.staging = None
        pages = self._promoted(run) if written and not run.tainted else []
        give = self.staging.give
        if pages and self._promote is not None:
            self._promote(PromotedPages(pages, lambda: None if staging is None else give(staging)))
        elif staging is not None:
            give(staging)

    def _promoted(self, run: LoadRun) -> list[PromotedPage]:
        """The pieces of the run's pages its job promotes, where they lie (never lent memory)."""
        wanted = {p.key: p for p in run.promotions}
        out = []
        for page in run.pages or ():
            promotion = wanted.get(page.read.page.key)
            if promotion is None or self.ctx.backends[page.source].in_place:
                continue
            targets = tuple(t for t in promotion.backends if t != page.source)
            view = page.base.numpy()[page.offset : page.offset + page.read.page_len].data
            out.append(PromotedPage(page.read.key, view, targets, promotion.retention))
        return out

    def _load_pages(self, job: LoadJob, run: LoadRun) -> list[Verified] | None:
        reads: list[ShardRead] = []
        source: list[str] = []
        spans = []
        for segment in job.segments:
            first = len(reads)
            for page in reversed(segment.pages):  # deepest first, as stores (LRU recency)
                codec = self.ctx.codecs[page.group]
                pieces = self._pieces(codec, page.layout)
                if pieces is None:
                    return None
                reads.extend(ShardRead(page, p, self.ctx.planner.piece_key(page.key, page.group, p), codec)
                             for p in pieces)  # fmt: skip
            source.extend([segment.backend] * (len(reads) - first))
            spans.append((segment.backend, range(first, len(reads))))
        staged = [i for name, indices in spans if not self.ctx.backends[name].in_place for i in indices]
        offsets, run.staging = stage_reads([reads[i] for i in staged], self.staging)
        rows = dict(zip(staged, offsets, strict=True))
        got: list[Verified | None] = [None] * len(reads)
        for name, indices in spans:
            self._fetch(name, reads, list(indices), got, run, rows)
        for name in job.fallbacks:
            missing = [i for i, v in enumerate(got) if v is None and source[i] != name]
            if missing:
                self._fetch(name, reads, missing, got, run, None)
        lost = sum(v is None for v in got)
        if lost:
            self.ctx.stats.add(missing_pages=lost)
            return None
        return [v for v in got if v is not None]

    def _pieces(self, codec: PageCodec, layout: tuple[int, ...]) -> list[Piece] | None:
        """The pieces to read of a page set in ``layout`` (() this engine's); None (the load
        fails: recompute) where this worker cannot place another layout's parts."""
        if not layout:
            return codec.read
        model = self.ctx.planner.model
        try:
            if model is None:
                raise LayerPartError("the whole model's layers were not sent")
            return codec.foreign(layout, model)
        except LayerPartError as exc:
            logger.warning("hybrid-offload: cannot read page sets of layout %s: %s", list(layout), exc)
            return None

    def _arena(self, memory: memoryview) -> HostMemory:
        """A backend's arena as a tensor and an array (made once)."""
        known = self._arenas.get(id(memory.obj))
        if known is None:
            array = np.frombuffer(memory, dtype=np.uint8)
            known = self._arenas[id(memory.obj)] = HostMemory(torch.from_numpy(array), array)
        return known

    def _fetch(
        self,
        name: str,
        reads: list[ShardRead],
        indices: Sequence[int],
        got: list[Verified | None],
        run: LoadRun,
        rows: dict[int, int] | None,
    ) -> None:
        """Take ``reads[indices]`` from backend ``name`` into ``got`` (checked): lent in place
        where it can, else read into their staging rows (``rows``: the first read of each) or
        into fresh buffers; pages the backend lacks or that fail a check stay None. Never
        raises a backend error."""
        backend = self.ctx.backends[name]
        keys = [reads[i].key for i in indices]
        found: list[FoundPage | None] = []
        started = self.ctx.timer()
        try:
            if backend.in_place:
                lease = backend.lease_batch(keys)
                run.leases.append(lease)
                arena = self._arena(lease.memory) if lease.memory is not None else None
                for view, offset in zip(lease.views, lease.offsets, strict=True):
                    if view is None or offset is None or arena is None:
                        found.append(None if view is None else self._copied(view))
                    else:
                        found.append(FoundPage(arena.tensor, arena.array, offset, view.nbytes))
            else:
                into: list[FoundPage] = []  # where each read goes, all its page length
                for i in indices:
                    if rows is not None and run.staging is not None:
                        into.append(FoundPage(run.staging, run.staging.numpy(), rows[i], reads[i].page_len))
                    else:
                        fresh = torch.empty(reads[i].page_len, dtype=torch.uint8)
                        into.append(FoundPage(fresh, fresh.numpy(), 0, reads[i].page_len))
                bufs = [b.array[b.offset : b.offset + b.size].data for b in into]
                sizes = backend.get_into(keys, bufs)
                found = [None if n is None else FoundPage(b.base, b.array, b.offset, n)
                         for b, n in zip(into, sizes, strict=True)]  # fmt: skip
        except BackendSkippedError:
            return
        except BackendError:  # a failed read is what the adaptive load policy measured
            run.tainted = run.tainted or (rows is not None and not backend.in_place)
            self.ctx.outbox.sample(name, 0, self.ctx.timer() - started, False)
            return
        finally:
            read_at = self.ctx.timer()
            run.read_s += read_at - started
        nbytes, npages = self._check(name, backend, reads, indices, found, got)
        run.verify_s += self.ctx.timer() - read_at
        self.ctx.outbox.sample(name, nbytes, read_at - started, True)
        self.ctx.stats.update(lambda c: c.add_loaded(name, npages, nbytes))

    @staticmethod
    def _copied(view: memoryview) -> FoundPage:
        array = np.frombuffer(view, dtype=np.uint8).copy()
        return FoundPage(torch.from_numpy(array), array, 0, view.nbytes)

    def _check(
        self,
        name: str,
        backend: Backend,
        reads: list[ShardRead],
        indices: Sequence[int],
        found: list[FoundPage | None],
        got: list[Verified | None],
    ) -> tuple[int, int]:
        """Check the pages ``found`` for ``reads[indices]`` and put the good ones into ``got``:
        headers here, all at once per (group, piece); payloads here on a CPU (fold64), on the
        device on a GPU; MACs here where the cache has a secret and the page crossed a process
        boundary. Bad pages are counted and deleted. Returns (bytes, pages) accepted."""
        key = self.ctx.page_key if not backend.in_place else None
        on_host = not self.ctx.transfers.device_path
        batches: dict[tuple[int, Piece], list[int]] = {}
        for k, (i, f) in enumerate(zip(indices, found, strict=True)):
            if f is None:
                self.ctx.stats.record_error(name, "missing_page")
            elif f.size != reads[i].page_len:
                self._bad_page(name, reads[i].key, PageFormatError(
                    f"page is {f.size} bytes, expected {reads[i].page_len}"), backend)  # fmt: skip
            else:
                batches.setdefault((reads[i].page.group, reads[i].piece), []).append(k)
        nbytes = npages = 0
        for (_, piece), ks in batches.items():
            codec = reads[indices[ks[0]]].codec
            template, hlen = codec.templates[piece], codec.header_lens[piece]
            hits = [f for f in (found[k] for k in ks) if f is not None]  # all are (batched above)
            heads = _headers(hits, hlen)
            pages = [reads[indices[k]].page for k in ks]
            ok, sums = check_headers(heads, template, [p.chunk_hash for p in pages],
                                     [p.chunk_index for p in pages])  # fmt: skip
            computed = _payload_sums(hits, hlen) if on_host and not key else None
            checked = zip(ks, hits, ok.tolist(), sums.tolist(), strict=True)
            for j, (k, hit, passed, stated) in enumerate(checked):
                read = reads[indices[k]]
                if passed and not key and not on_host:  # the payload is checked on the device
                    got[indices[k]] = Verified(read, hit.base, hit.offset, name, stated)
                    nbytes += hit.size
                    npages += 1
                    continue
                page_bytes = hit.array[hit.offset : hit.offset + hit.size].data
                try:
                    if not passed:
                        check_header(page_bytes, template, read.page.chunk_hash, read.page.chunk_index)
                        raise PageFormatError("header does not match")  # check_headers is stricter
                    if key:
                        check_mac(page_bytes, template, key)
                    elif computed is not None and computed[j] != stated:
                        raise PageFormatError("payload checksum mismatch")
                except ForeignLayersError:  # another grouping's valid page: a miss, left alone
                    self.ctx.stats.record_error(name, "missing_page")
                    continue
                except PageFormatError as exc:
                    self._bad_page(name, read.key, exc, backend)
                    continue
                checksum = None if key or on_host else stated
                got[indices[k]] = Verified(read, hit.base, hit.offset, name, checksum)
                nbytes += hit.size
                npages += 1
        return nbytes, npages

    def _bad_page(self, name: str, key: str, exc: PageFormatError, backend: Backend | None = None) -> None:
        """A page that failed a check: counted, logged, deleted (so that a store rewrites it)."""
        self.ctx.stats.add(bad_pages=1)
        self.ctx.stats.record_error(name, "bad_page")
        self._log_bad_page(name, key, exc)
        self._delete_quietly(backend or self.ctx.backends[name], key)

    def handle_preemptions(self, req_ids: Iterable[str]) -> None:
        """Before vLLM reuses the blocks of preempted requests. Stores were copied out in
        ``wait_for_save`` already, so there is nothing to protect; a load still in flight for
        such a request (vLLM does not preempt requests waiting for KV, so this is defensive)
        is waited for (on a GPU the load thread may be writing its blocks) and reported as
        failed."""
        for req_id in req_ids:
            future = self._loads.get(req_id)
            if future is not None:
                wait([future])
                self._preempted.add(req_id)
                logger.warning("request %s preempted with a load in flight; its load is dropped", req_id)

    def write_finished(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """Write the pages of every completed load into vLLM's KV cache (CPU; on a GPU the load
        thread wrote them); (finished receiving, failed receiving) since the last call, failed
        ones in both.

        ``wait_s`` > 0 (an idle engine step): with loads in flight and none complete, first
        wait up to ``wait_s`` for one, instead of returning to a step loop that would spin
        (taking the GIL and a core from the load thread) only to ask again.

        Nothing is ever reported as finished sending: stores copy out synchronously, and when a
        request finishes while its load is in flight, vLLM frees its blocks on the
        finished-receiving report itself.
        """
        recving: set[str] = set()
        failed: set[str] = set()
        if wait_s > 0 and self._loads and not any(f.done() for f in self._loads.values()):
            wait(self._loads.values(), timeout=wait_s, return_when=FIRST_COMPLETED)
        for req_id, future in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[req_id]
            clears = self._clears.pop(req_id, ())
            recving.add(req_id)
            run: LoadRun = future.result()  # the load thread catches everything
            if req_id in self._preempted:
                self._preempted.discard(req_id)
                self._done_with(run)
                failed.add(req_id)
                continue
            if run.pages is None:
                failed.add(req_id)
                continue
            writing = self.ctx.timer()
            if not run.written:
                try:
                    assert run.plan is not None
                    write_pages(run.plan, self.ctx.layouts)
                    clear_ranges(clears, self.ctx.layouts)
                except Exception:
                    logger.exception("hybrid-offload load of request %s failed", req_id)
                    failed.add(req_id)
                finally:
                    self._done_with(run, written=req_id not in failed)
            self._count(run, writing, self.ctx.timer())
        self.switch.loading(bool(self._loads))
        return recving, failed

    def _count(self, run: LoadRun, writing: float, written: float) -> None:
        """A load is complete: count its phases (``load_*_seconds``): ``write`` is the
        model-runner thread's part (the writes on CPU; on a GPU the load thread's device work,
        enqueue to completion), ``total`` ends when it was reported."""
        phases = {
            "queued": run.started - run.submitted,
            "prepare": run.finished - run.started - run.read_s - run.verify_s - run.device_s,
            "read": run.read_s,
            "verify": run.verify_s,
            "ready": writing - run.finished,
            "write": run.device_s if run.written else written - writing,
            "total": written - run.submitted,
        }
        self.ctx.stats.update(lambda c: c.record_load(phases))

    def _delete_quietly(self, backend: Backend, key: str) -> None:
        """Remove a page that failed verification, so that a later store rewrites it."""
        with contextlib.suppress(BackendError):  # counted by the tier's wrappers
            backend.delete_batch([key])

    def _log_bad_page(self, name: str, key: str, exc: PageFormatError) -> None:
        """The first bad page of a backend is a warning; later ones are counted (metrics)
        and logged at debug level, so a corrupted store does not flood the log."""
        with self._lock:
            first = name not in self._bad_page_logged
            self._bad_page_logged.add(name)
        log = logger.warning if first else logger.debug
        log("bad page %s from %s: %s (a miss; deleted; later ones are logged at debug level)", key, name, exc)

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
        self.switch.loading(False)
