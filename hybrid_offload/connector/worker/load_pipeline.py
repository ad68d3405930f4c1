"""The worker's load pipeline: read and verify pages on the load thread, write them into vLLM's
KV cache on the model-runner thread.

Worker side. :meth:`LoadPipeline.start` hands load jobs to the load thread, which reads each
page into its staging row, verifies it there and plans the writes (every per-page step);
:meth:`LoadPipeline.write_finished` (model-runner thread, between forwards) enqueues the writes
into the blocks vLLM allocated for the waiting requests (on a GPU: one copy to the device and
the scatters on the load stream, see :mod:`.device`) and reports each request once its writes
are complete. A backend error or a bad page never raises into vLLM: the page is a miss, the
load fails as a whole, and vLLM recomputes the request.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from hybrid_offload.backends.base import Backend, BackendError
from hybrid_offload.backends.wrappers import BackendSkippedError
from hybrid_offload.connector.metadata import ClearRange, LoadJob, PageJob
from hybrid_offload.connector.worker.context import WorkerContext
from hybrid_offload.connector.worker.device import DeviceTransfers, Ready
from hybrid_offload.connector.worker.page_codec import PageCodec
from hybrid_offload.connector.worker.staging import (
    Decoded,
    ShardRead,
    WritePlan,
    plan_writes,
    stage_reads,
    write_pages,
)
from hybrid_offload.connector.worker.switch_interval import LoadSwitchInterval
from hybrid_offload.core.layer_parts import LayerPartError
from hybrid_offload.core.page_format import ForeignLayersError, PageFormatError, verify_page
from hybrid_offload.core.planner import Piece
from hybrid_offload.engine.kv_layout import AttentionGroupLayout

logger = logging.getLogger(__name__)


@dataclass
class LoadRun:
    """What the load thread made of one job: the verified shards (None: the load failed) and
    its timings (``timer`` seconds; read and verify summed over backends)."""

    decoded: list[Decoded] | None = None
    submitted: float = 0.0
    started: float = 0.0
    finished: float = 0.0
    read_s: float = 0.0
    verify_s: float = 0.0
    #: the staging memory of the load, and whether a failed read may still write into it
    staging: torch.Tensor | None = None
    tainted: bool = False
    #: the writes of the verified shards, planned on the load thread
    plan: WritePlan | None = None


class LoadPipeline:
    """The load thread and the writes of finished loads."""

    def __init__(self, ctx: WorkerContext, staging_pool_bytes: int, switch_interval_s: float) -> None:
        self.ctx = ctx
        self._staging_pool_bytes = staging_pool_bytes
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="hybrid-offload-load")
        self._loads: dict[str, Future] = {}
        #: loads whose writes are enqueued on the device and not complete yet
        self._writing: dict[str, tuple[Ready, LoadRun, float, float]] = {}
        self._clears: dict[str, tuple[ClearRange, ...]] = {}
        self._preempted: set[str] = set()
        self.switch = LoadSwitchInterval(switch_interval_s)
        self._lock = threading.Lock()
        self._bad_page_logged: set[str] = set()
        self.use_device(ctx.transfers)

    def use_device(self, transfers: DeviceTransfers) -> None:
        """Staging memory for ``transfers.device`` (pinned where it has them)."""
        self.staging = transfers.host_pool(self._staging_pool_bytes)

    def in_flight(self, req_id: str) -> Future | None:
        """The load thread's future of ``req_id``'s load, if one is in flight."""
        return self._loads.get(req_id)

    def start(self, loads: list[LoadJob]) -> None:
        for job in loads:
            self._loads[job.req_id] = self._loader.submit(self._load, job, self.ctx.timer())
            self._clears[job.req_id] = job.clears
        self.switch.loading(bool(self._loads))

    def _load(self, job: LoadJob, submitted: float) -> LoadRun:
        """Load thread: read and verify this rank's shards of every page of a job (decoded
        None if any is unusable), timed.

        Each segment is read from its backend; shards missing or bad there (evicted since the
        lookup, corrupted, backend down) are read from the fallbacks in order.
        """
        run = LoadRun(submitted=submitted, started=self.ctx.timer())
        run.decoded = self._load_pages(job, run)
        if run.decoded is not None:
            run.plan = plan_writes(run.decoded, self.ctx.layouts, run.staging)
        run.finished = self.ctx.timer()
        return run

    def _load_pages(self, job: LoadJob, run: LoadRun) -> list[Decoded] | None:
        wanted: list[tuple[PageJob, int, str, PageCodec]] = []
        source: list[str] = []
        spans = []
        for segment in job.segments:
            first = len(wanted)
            for page in reversed(segment.pages):  # deepest first, as stores (LRU recency)
                codec = self.ctx.codecs[page.group]
                pieces = self._pieces(codec, page.layout)
                if pieces is None:
                    return None
                wanted.extend((page, p, self.ctx.planner.piece_key(page.key, page.group, p), codec)
                              for p in pieces)  # fmt: skip
            source.extend([segment.backend] * (len(wanted) - first))
            spans.append((segment.backend, range(first, len(wanted))))
        reads, run.staging = stage_reads(wanted, self.staging)
        decoded: list[Decoded | None] = [None] * len(reads)
        for name, indices in spans:
            self._read(name, reads, indices, decoded, run, staged=True)
        for name in job.fallbacks:
            missing = [i for i, d in enumerate(decoded) if d is None and source[i] != name]
            if missing:
                self._read(name, reads, missing, decoded, run, staged=False)
        lost = sum(d is None for d in decoded)
        if lost:
            with self.ctx.stats.lock:
                self.ctx.stats.counters.missing_pages += lost
            return None
        return [d for d in decoded if d is not None]

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

    def _read(
        self,
        name: str,
        reads: list[ShardRead],
        indices: Sequence[int],
        decoded: list[Decoded | None],
        run: LoadRun,
        staged: bool,
    ) -> None:
        """Read ``reads[indices]`` from backend ``name`` into ``decoded`` (verified), into their
        staging rows if ``staged`` (the first read of each) else into fresh buffers; shards the
        backend lacks or that fail verification stay None. Never raises a backend error."""
        backend = self.ctx.backends[name]
        bufs: list[memoryview] = [
            reads[i].staging() if staged else memoryview(bytearray(reads[i].codec.page_lens[reads[i].shard]))
            for i in indices
        ]
        started = self.ctx.timer()
        try:
            sizes = backend.get_into([reads[i].key for i in indices], bufs)
        except BackendSkippedError:
            return
        except BackendError:  # a failed read is what the adaptive load policy measured
            run.tainted = run.tainted or staged
            self.ctx.outbox.sample(name, 0, self.ctx.timer() - started, False)
            return
        finally:
            read_at = self.ctx.timer()
            run.read_s += read_at - started
        nbytes = npages = 0
        for i, buf, size in zip(indices, bufs, sizes, strict=True):
            read = reads[i]
            if size is None:
                self.ctx.stats.record_error(name, "missing_page")
                continue
            try:
                payload = verify_page(
                    buf[:size],
                    read.codec.templates[read.shard],
                    read.page.chunk_hash,
                    read.page.chunk_index,
                    self.ctx.page_key,
                )
            except ForeignLayersError:  # another grouping's valid page: a miss, left alone
                self.ctx.stats.record_error(name, "missing_page")
                continue
            except PageFormatError as exc:
                with self.ctx.stats.lock:
                    self.ctx.stats.counters.bad_pages += 1
                self.ctx.stats.record_error(name, "bad_page")
                self._log_bad_page(name, read.key, exc)
                self._delete_quietly(backend, read.key)
                continue
            decoded[i] = Decoded(read, payload, staged)
            nbytes += size
            npages += 1
        run.verify_s += self.ctx.timer() - read_at
        self.ctx.outbox.sample(name, nbytes, read_at - started, True)
        with self.ctx.stats.lock:
            self.ctx.stats.counters.pages_loaded += npages
            self.ctx.stats.counters.bytes_loaded += nbytes
            counters = self.ctx.stats.counters.backend(name)
            counters.loaded_pages += npages
            counters.loaded_bytes += nbytes

    def handle_preemptions(self, req_ids: Iterable[str]) -> None:
        """Before vLLM reuses the blocks of preempted requests. Stores were copied out in
        ``wait_for_save`` already, so there is nothing to protect; a load still in flight for
        such a request (vLLM does not preempt requests waiting for KV, so this is defensive)
        is reported as failed without writing into blocks it no longer owns."""
        for req_id in req_ids:
            writing = self._writing.get(req_id)
            if writing is not None:
                writing[0].wait()  # its blocks must be written before vLLM reuses them
            if req_id in self._loads:
                self._preempted.add(req_id)
                logger.warning("request %s preempted with a load in flight; its load is dropped", req_id)

    def write_finished(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """Write the pages of every completed load into vLLM's KV cache; (finished receiving,
        failed receiving) since the last call, failed ones in both.

        ``wait_s`` > 0 (an idle engine step): with loads in flight and none complete, first
        wait up to ``wait_s`` for one, instead of returning to a step loop that would spin
        (taking the GIL and a core from the load thread) only to ask again.

        Runs on the model-runner thread between forwards: the writes happen here, not on the load
        thread (torch work there competes with the forward's OpenMP threads and measured ~10x
        slower).

        Nothing is ever reported as finished sending: stores copy out synchronously, and when a
        request finishes while its load is in flight, vLLM frees its blocks on the
        finished-receiving report itself.
        """
        recving: set[str] = set()
        failed: set[str] = set()
        self._written(recving)
        if wait_s > 0 and not recving and self._loads and not any(f.done() for f in self._loads.values()):
            wait(self._loads.values(), timeout=wait_s, return_when=FIRST_COMPLETED)
        for req_id, future in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[req_id]
            clears = self._clears.pop(req_id, ())
            if req_id in self._preempted:
                self._preempted.discard(req_id)
                recving.add(req_id)
                failed.add(req_id)
                continue
            try:
                run: LoadRun = future.result()
                decoded = run.decoded
                if decoded is not None:
                    writing = self.ctx.timer()
                    with self.ctx.transfers.loading():
                        self._write_into_kv_cache(run.plan or decoded, clears, run.staging)
                        ready = self.ctx.transfers.loaded()
                    enqueued = self.ctx.timer()
                    if ready.done():  # CPU: written already
                        self._report_written(run, writing, enqueued, enqueued, recving, req_id)
                    else:
                        self._writing[req_id] = (ready, run, writing, enqueued)
                elif run.staging is not None and not run.tainted:
                    self.staging.give(run.staging)
            except Exception:
                logger.exception("hybrid-offload load of request %s failed", req_id)
                decoded = None
            if decoded is None:
                recving.add(req_id)
                failed.add(req_id)
        self._written(recving)
        if wait_s > 0 and not recving and self._writing:
            next(iter(self._writing.values()))[0].wait()  # an idle step: only this copy is left
            self._written(recving)
        self.switch.loading(bool(self._loads or self._writing))
        return recving, failed

    def _written(self, recving: set[str]) -> None:
        """Add the loads whose writes completed on the device to ``recving``; their staging
        memory goes back to the pool (no copy reads it any more)."""
        for req_id, (ready, run, writing, enqueued) in list(self._writing.items()):
            if not ready.done():
                continue
            del self._writing[req_id]
            self._report_written(run, writing, enqueued, self.ctx.timer(), recving, req_id)

    def _report_written(
        self, run: LoadRun, writing: float, enqueued: float, written: float, recving: set[str], req_id: str
    ) -> None:
        """A load's writes are complete: report it, give its staging back, count its phases
        (``load_*_seconds``): ``write`` is the model-runner thread's part (writing on CPU,
        enqueuing the copies on CUDA), ``total`` ends when the writes were seen complete."""
        recving.add(req_id)
        if run.staging is not None and not run.tainted:
            self.staging.give(run.staging)
        phases = {
            "queued": run.started - run.submitted,
            "prepare": run.finished - run.started - run.read_s - run.verify_s,
            "read": run.read_s,
            "verify": run.verify_s,
            "ready": writing - run.finished,
            "write": enqueued - writing,
            "total": written - run.submitted,
        }
        with self.ctx.stats.lock:
            self.ctx.stats.counters.record_load(phases)

    def _write_into_kv_cache(
        self, decoded: WritePlan | list[Decoded], clears: Iterable[ClearRange], staging: torch.Tensor | None
    ) -> None:
        """Scatter a load's verified pages into vLLM's KV cache, then zero the parts of its last
        attention blocks that it did not fill (enqueued only, on a device with streams)."""
        write_pages(decoded, self.ctx.layouts, staging, self.ctx.transfers)
        self._clear(clears)

    def _clear(self, clears: Iterable[ClearRange]) -> None:
        """Zero the parts of a load's last attention blocks that the load did not fill."""
        for clear in clears:
            layout = self.ctx.layouts.get(clear.group)
            if layout is None:
                continue  # a pipeline stage holding no layer of this group
            assert isinstance(layout, AttentionGroupLayout)
            layout.zero(layout.token_index([clear.block_id], clear.first_token, clear.num_tokens))

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
