"""Worker side of the connector: moves bytes between vLLM's KV cache and the backends.

Threads and blocking:

* The model-runner thread calls :meth:`OffloadWorker.save` in ``wait_for_save`` (after the
  forward): the only synchronous work is copying this step's completed chunks and boundary
  states out of the KV cache into page buffers. Pages the scheduler cannot key yet are *held*
  (kept by request, group and chunk) until a commit names their key, or dropped when their
  request is released. Sealing (checksums) and backend puts run on the store thread, which
  reports every page set it finished (``settled``) so that lookups waiting for it go on.
* :meth:`OffloadWorker.start_loads` hands load jobs to the load thread, which reads and
  verifies pages; :meth:`OffloadWorker.write_finished_loads` (model-runner thread, between forwards)
  writes them into the blocks vLLM allocated for the waiting requests and reports them.
* Backends are the tiers' wrapped backends (:mod:`.tiers`): backoff after failures, timing and
  error counting happen in the wrappers, so this module only moves bytes; a
  :class:`~hybrid_offload.backends.base.BackendError` here means misses.
* A backend error or a bad page never raises into vLLM: the page is a miss, the load fails
  as a whole, and vLLM recomputes the request.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from hybrid_offload.backends.base import Backend, BackendError
from hybrid_offload.backends.wrappers import BackendSkippedError
from hybrid_offload.connector.config import Tier
from hybrid_offload.connector.device import DeviceTransfers, Ready
from hybrid_offload.connector.held import HeldCopies
from hybrid_offload.connector.memory_pool import LOAD_POOL_BYTES, STORE_POOL_BYTES
from hybrid_offload.connector.metadata import (
    ClearRange,
    CommitJob,
    LoadJob,
    LoadSample,
    OffloadMetadata,
    OffloadWorkerMetadata,
    PageJob,
    StoreJob,
    TouchJob,
)
from hybrid_offload.connector.page_codec import PageCodec
from hybrid_offload.connector.staging import (
    Decoded,
    ShardRead,
    WritePlan,
    gather_rows,
    plan_writes,
    stage_reads,
    write_pages,
)
from hybrid_offload.connector.switch_interval import LoadSwitchInterval
from hybrid_offload.connector.tiers import OpenTier, WorkerRecorder, open_tier, write_model_card
from hybrid_offload.core.metrics import Locked, WorkerCounters
from hybrid_offload.core.page_format import PageFormatError, seal_page, verify_page
from hybrid_offload.core.planner import HybridOffloadPlanner
from hybrid_offload.core.spec import ModelSpec
from hybrid_offload.engine.kv_layout import AttentionGroupLayout, MambaGroupLayout, build_layouts

logger = logging.getLogger(__name__)

_STOP = object()


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


#: one shard's sealed-to-be page buffer, queued for the store thread
QueuedShard = tuple[StoreJob, int, bytearray | memoryview]


class OffloadWorker:
    """Worker-side logic behind the connector facade."""

    def __init__(
        self,
        spec: ModelSpec,
        planner: HybridOffloadPlanner,
        backends: tuple[Tier, ...],
        max_pending_store_bytes: int,
        *,
        load_switch_interval_s: float = 0.0,
        page_key: bytes | None = None,
        staging_pool_bytes: int = LOAD_POOL_BYTES,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``page_key``: pages are signed with it and must verify under it (see ``page_format``).
        ``clock`` drives the backends' backoff; ``timer`` times the phases of loads;
        ``staging_pool_bytes``: free load staging memory kept for the next loads."""
        self.spec = spec
        self._staging_pool_bytes = staging_pool_bytes
        self._timer = timer
        self.planner = planner
        self._page_key = page_key
        self.codecs = {g.index: PageCodec(spec, g, planner.chunk_tokens) for g in spec.groups}
        self.layouts: dict[int, AttentionGroupLayout | MambaGroupLayout] = {}
        self.stats = Locked(WorkerCounters())
        recorder = WorkerRecorder(self.stats)
        self.tiers: dict[str, OpenTier] = {
            t.name: open_tier(t, i, recorder, clock) for i, t in enumerate(backends)
        }
        #: the opened backends, wrapped (health gate, instruments): pure data movement here
        self.backends: dict[str, Backend] = {name: t.backend for name, t in self.tiers.items()}
        for t in backends:
            self.stats.update_backend(t.name, available=1, capacity_bytes=t.backend.capacity_bytes)
        self._max_pending = max_pending_store_bytes
        self._pending_bytes = 0
        self._held = HeldCopies()
        self._lock = threading.Lock()
        self._stored: dict[str, list[str]] = {}
        self._settled: list[str] = []
        self._load_samples: dict[str, list[LoadSample]] = {}
        self._store_queue: queue.Queue = queue.Queue()
        self._store_thread = threading.Thread(
            target=self._store_loop, name="hybrid-offload-store", daemon=True
        )
        self._store_thread.start()
        threading.Thread(target=self._prepare_data_paths, name="hybrid-offload-prepare", daemon=True).start()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="hybrid-offload-load")
        self._use_device(DeviceTransfers("cpu"))
        self._loads: dict[str, Future] = {}
        #: loads whose writes are enqueued on the device and not complete yet
        self._writing: dict[str, tuple[Ready, LoadRun, float, float]] = {}
        self._clears: dict[str, tuple[ClearRange, ...]] = {}
        self._preempted: set[str] = set()
        self._switch = LoadSwitchInterval(load_switch_interval_s)
        self._bad_page_logged: set[str] = set()
        self._namespace_checked = False

    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], attention_format: str | None = None
    ) -> None:
        """Address the tensors vLLM registered (``attention_format``: see ``build_layouts``)."""
        self.layouts = build_layouts(self.spec.groups, kv_caches, self.spec.num_blocks, attention_format)
        devices = {t.device for t in kv_caches.values()}
        if len(devices) == 1:
            (device,) = devices
            if device != self.transfers.device:
                self._use_device(DeviceTransfers(device))

    def _use_device(self, transfers: DeviceTransfers) -> None:
        """Move bytes to and from ``transfers.device`` (host pools pinned where it has them)."""
        self.transfers = transfers
        self._staging = transfers.host_pool(self._staging_pool_bytes)
        self._store_rows = transfers.host_pool(STORE_POOL_BYTES)
        self._hold_rows = transfers.host_pool(0)  # held copies are kept outside the pool

    def _prepare_data_paths(self) -> None:
        """Backends' one-time transfer setup, off the forward path, so the first store or load
        does not pay for it (a NIXL agent and handshake take about a second here)."""
        for name, backend in self.backends.items():
            try:
                backend.prepare_data_path()
            except BackendError as exc:
                logger.warning(
                    "backend %s is not reachable at start-up (%s): lookups miss and stores skip it "
                    "until it answers; requests recompute",
                    name,
                    exc,
                )
            except Exception:  # best effort: the first put or get sets it up as well
                logger.exception("backend %s: preparing the data path failed", name)
        if self.spec.tp_rank == 0 and self.spec.pp_size == 1:  # a stage cannot describe the model
            write_model_card(self.spec, self.planner.chunk_tokens, self.tiers)

    # ---- stores -----------------------------------------------------------------------
    def save(self, meta: OffloadMetadata) -> None:
        """``wait_for_save``: copy this step's pages out (stores and holds), commit held pages,
        drop what released requests still hold, then queue the recency refreshes."""
        self.copy_out(meta.stores)
        self.commit(meta.commits)
        for req_id in meta.releases:
            self._held.release(req_id)
        for touch in meta.touches:
            self._store_queue.put(touch)

    def copy_out(self, stores: list[StoreJob]) -> None:
        """Copy this step's pages (this rank's shards of them) out of the KV cache: stores are
        queued for the store thread, holds kept until committed (timed: ``copy_out_seconds``)."""
        stores = [job for job in stores if self.codecs[job.page.group].written]  # others: not ours
        if not stores or not self.layouts:
            self._settle([job.page.key for job in stores if not job.hold])
            return
        started = self._timer()
        queued: list[StoreJob] = []
        nbytes = 0
        for job in stores:
            codec = self.codecs[job.page.group]
            size = sum(codec.page_lens[p] for p in codec.written)
            if not self._admit(job, size, nbytes):
                continue
            if job.hold:  # kept for steps: rows of a block of its own, not from the pool
                page = job.page
                entries, _ = gather_rows([job], self.codecs, self.layouts, self._hold_rows, self.transfers)
                shards = [(shard, buf) for _, shard, buf in entries]
                newest_only = not codec.group.is_attention  # the newest state replaces older ones
                self._held.hold((job.req_id, page.group, page.chunk_index), shards, newest_only=newest_only)
            else:
                queued.append(job)
                nbytes += size
        if queued:
            batch, blocks = gather_rows(queued, self.codecs, self.layouts, self._store_rows, self.transfers)
            self._queue(batch, nbytes, blocks)
        elapsed = self._timer() - started
        with self.stats.lock:
            self.stats.counters.copy_out_seconds += elapsed

    def _admit(self, job: StoreJob, size: int, queued: int) -> bool:
        """Whether the pending-bytes budget takes ``size`` more bytes (holds have a budget of
        their own); a dropped store is counted and settled."""
        with self._lock:
            used = self._held.nbytes if job.hold else self._pending_bytes + queued
            if used + size <= self._max_pending:
                return True
        with self.stats.lock:
            self.stats.counters.stores_dropped += 1
        if not job.hold:
            self._settle([job.page.key])
        return False

    def commit(self, commits: list[CommitJob]) -> None:
        """Queue held pages under the keys the scheduler knows now (a page no longer held,
        e.g. dropped for the budget, is settled as it is)."""
        batch: list[QueuedShard] = []
        nbytes = 0
        for commit in commits:
            if not self.codecs[commit.page.group].written:
                continue  # a group this worker writes no piece of (another stage's layers)
            shards = self._held.take((commit.req_id, commit.page.group, commit.page.chunk_index))
            if shards is None:
                self._settle([commit.page.key])
                continue
            job = StoreJob(commit.page, commit.backends, commit.req_id)
            batch.extend((job, shard, buf) for shard, buf in shards)
            nbytes += sum(len(buf) for _, buf in shards)
        self._queue(batch, nbytes)

    def _queue(self, batch: list[QueuedShard], nbytes: int, blocks: Sequence[torch.Tensor] = ()) -> None:
        """Queue ``batch``; ``blocks`` (its buffers' memory) go back to the pool once stored. The
        store thread starts on it once every copy out of the device enqueued so far is done."""
        if not batch:
            return
        with self._lock:
            self._pending_bytes += nbytes
        self._store_queue.put((batch, nbytes, blocks, self.transfers.stored()))
        with self.stats.lock:
            self.stats.counters.pages_copied_out += len(batch)
            self.stats.counters.bytes_copied_out += nbytes

    def _settle(self, keys: list[str]) -> None:
        if keys:
            with self._lock:
                self._settled.extend(keys)

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
            batch, nbytes, blocks, ready = item
            try:
                ready.wait()
                self._store_batch(batch)
                for block in blocks:
                    self._store_rows.give(block)  # put_batch copied what it keeps
            except Exception:  # the store thread must survive anything a backend does
                logger.exception("hybrid-offload store batch failed")
                with self.stats.lock:
                    self.stats.counters.store_batch_errors += 1
            finally:
                with self._lock:
                    self._pending_bytes -= nbytes
                self._settle(list(dict.fromkeys(job.page.key for job, _, _ in batch)))
                self._store_queue.task_done()

    def _check_namespace(self, key: str) -> None:
        """Once: the scheduler's keys must carry this worker's fingerprint, or pages stored now
        would never be found by an engine whose scheduler agrees with its workers."""
        if self._namespace_checked:
            return
        self._namespace_checked = True
        if not key.startswith(self.spec.fingerprint + "-"):
            logger.error(
                "hybrid-offload: the scheduler keys pages under %s but this worker's model "
                "fingerprint is %s; pages stored now are not shared with other engines",
                key.partition("-")[0],
                self.spec.fingerprint,
            )

    def _store_batch(self, batch: list[QueuedShard]) -> None:
        per_backend: dict[str, list[tuple[str, bytearray]]] = {}
        if batch:
            self._check_namespace(batch[0][0].page.key)
        # Deepest page first: a backend's LRU then keeps a prefix more recent than the pages
        # that need it (a state needs every chunk before it), and evicts from the deep end.
        for job, shard, buf in reversed(batch):
            seal_page(buf, self.codecs[job.page.group].header(job.page, shard), self._page_key)
            key = self.planner.piece_key(job.page.key, job.page.group, shard)
            for name in job.backends:
                per_backend.setdefault(name, []).append((key, buf))
        for name, items in per_backend.items():
            try:
                results = self.backends[name].put_batch(items)
            except BackendError:
                with self.stats.lock:
                    self.stats.counters.backend(name).store_failures += len(items)
                continue
            stored = [key for (key, _), ok in zip(items, results, strict=True) if ok]
            with self._lock:
                self._stored.setdefault(name, []).extend(stored)
            with self.stats.lock:
                counters = self.stats.counters.backend(name)
                counters.stored_pages += len(stored)
                counters.stored_bytes += sum(len(b) for (k, b), ok in zip(items, results, strict=True) if ok)
                counters.store_failures += len(items) - len(stored)

    def _touch(self, job: TouchJob) -> None:
        """Store thread: refresh this rank's shards of ``job.pages`` in order."""
        keys = [
            self.planner.piece_key(key, group, shard)
            for key, group in job.pages
            for shard in self.codecs[group].written
        ]
        for name in job.backends:
            backend = self.backends.get(name)
            if backend is None or not backend.touch_refreshes or not keys:
                continue
            try:
                backend.touch_batch(keys)
            except BackendError:
                continue  # counted by the tier's wrappers; recency is best effort

    def flush(self, timeout: float | None = None) -> None:
        """Wait until queued stores are written (used at shutdown and by tests)."""
        done = threading.Event()
        threading.Thread(target=lambda: (self._store_queue.join(), done.set()), daemon=True).start()
        done.wait(timeout)

    # ---- loads ------------------------------------------------------------------------
    def start_loads(self, loads: list[LoadJob]) -> None:
        for job in loads:
            self._loads[job.req_id] = self._loader.submit(self._load, job, self._timer())
            self._clears[job.req_id] = job.clears
        self._switch.loading(bool(self._loads))

    def _load(self, job: LoadJob, submitted: float) -> LoadRun:
        """Load thread: read and verify this rank's shards of every page of a job (decoded
        None if any is unusable), timed.

        Each segment is read from its backend; shards missing or bad there (evicted since the
        lookup, corrupted, backend down) are read from the fallbacks in order.
        """
        run = LoadRun(submitted=submitted, started=self._timer())
        run.decoded = self._load_pages(job, run)
        if run.decoded is not None:
            run.plan = plan_writes(run.decoded, self.layouts, run.staging)
        run.finished = self._timer()
        return run

    def _load_pages(self, job: LoadJob, run: LoadRun) -> list[Decoded] | None:
        wanted: list[tuple[PageJob, int, str, PageCodec]] = []
        source: list[str] = []
        spans = []
        for segment in job.segments:
            first = len(wanted)
            for page in reversed(segment.pages):  # deepest first, as stores (LRU recency)
                codec = self.codecs[page.group]
                wanted.extend((page, p, self.planner.piece_key(page.key, page.group, p), codec)
                              for p in codec.read)  # fmt: skip
            source.extend([segment.backend] * (len(wanted) - first))
            spans.append((segment.backend, range(first, len(wanted))))
        reads, run.staging = stage_reads(wanted, self._staging)
        decoded: list[Decoded | None] = [None] * len(reads)
        for name, indices in spans:
            self._read(name, reads, indices, decoded, run, staged=True)
        for name in job.fallbacks:
            missing = [i for i, d in enumerate(decoded) if d is None and source[i] != name]
            if missing:
                self._read(name, reads, missing, decoded, run, staged=False)
        lost = sum(d is None for d in decoded)
        if lost:
            with self.stats.lock:
                self.stats.counters.missing_pages += lost
            return None
        return [d for d in decoded if d is not None]

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
        backend = self.backends[name]
        bufs: list[memoryview] = [
            reads[i].staging() if staged else memoryview(bytearray(reads[i].codec.page_lens[reads[i].shard]))
            for i in indices
        ]
        started = self._timer()
        try:
            sizes = backend.get_into([reads[i].key for i in indices], bufs)
        except BackendSkippedError:
            return
        except BackendError:  # a failed read is what the adaptive load policy measured
            run.tainted = run.tainted or staged
            self._sample(name, 0, self._timer() - started, False)
            return
        finally:
            read_at = self._timer()
            run.read_s += read_at - started
        nbytes = npages = 0
        for i, buf, size in zip(indices, bufs, sizes, strict=True):
            read = reads[i]
            if size is None:
                self.stats.record_error(name, "missing_page")
                continue
            try:
                payload = verify_page(
                    buf[:size],
                    read.codec.templates[read.shard],
                    read.page.chunk_hash,
                    read.page.chunk_index,
                    self._page_key,
                )
            except PageFormatError as exc:
                with self.stats.lock:
                    self.stats.counters.bad_pages += 1
                self.stats.record_error(name, "bad_page")
                self._log_bad_page(name, read.key, exc)
                self._delete_quietly(backend, read.key)
                continue
            decoded[i] = Decoded(read, payload, staged)
            nbytes += size
            npages += 1
        run.verify_s += self._timer() - read_at
        self._sample(name, nbytes, read_at - started, True)
        with self.stats.lock:
            self.stats.counters.pages_loaded += npages
            self.stats.counters.bytes_loaded += nbytes
            counters = self.stats.counters.backend(name)
            counters.loaded_pages += npages
            counters.loaded_bytes += nbytes

    def _sample(self, name: str, nbytes: int, seconds: float, ok: bool) -> None:
        with self._lock:
            self._load_samples.setdefault(name, []).append((nbytes, seconds, ok))

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

    def write_finished_loads(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
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
                    writing = self._timer()
                    with self.transfers.loading():
                        self._write_into_kv_cache(run.plan or decoded, clears, run.staging)
                        ready = self.transfers.loaded()
                    enqueued = self._timer()
                    if ready.done():  # CPU: written already
                        self._report_written(run, writing, enqueued, enqueued, recving, req_id)
                    else:
                        self._writing[req_id] = (ready, run, writing, enqueued)
                elif run.staging is not None and not run.tainted:
                    self._staging.give(run.staging)
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
        self._switch.loading(bool(self._loads or self._writing))
        return recving, failed

    def _written(self, recving: set[str]) -> None:
        """Add the loads whose writes completed on the device to ``recving``; their staging
        memory goes back to the pool (no copy reads it any more)."""
        for req_id, (ready, run, writing, enqueued) in list(self._writing.items()):
            if not ready.done():
                continue
            del self._writing[req_id]
            self._report_written(run, writing, enqueued, self._timer(), recving, req_id)

    def _report_written(
        self, run: LoadRun, writing: float, enqueued: float, written: float, recving: set[str], req_id: str
    ) -> None:
        """A load's writes are complete: report it, give its staging back, count its phases
        (``load_*_seconds``): ``write`` is the model-runner thread's part (writing on CPU,
        enqueuing the copies on CUDA), ``total`` ends when the writes were seen complete."""
        recving.add(req_id)
        if run.staging is not None and not run.tainted:
            self._staging.give(run.staging)
        phases = {
            "queued": run.started - run.submitted,
            "prepare": run.finished - run.started - run.read_s - run.verify_s,
            "read": run.read_s,
            "verify": run.verify_s,
            "ready": writing - run.finished,
            "write": enqueued - writing,
            "total": written - run.submitted,
        }
        with self.stats.lock:
            self.stats.counters.record_load(phases)

    def _write_into_kv_cache(
        self, decoded: WritePlan | list[Decoded], clears: Iterable[ClearRange], staging: torch.Tensor | None
    ) -> None:
        """Scatter a load's verified pages into vLLM's KV cache, then zero the parts of its last
        attention blocks that it did not fill (enqueued only, on a device with streams)."""
        write_pages(decoded, self.layouts, staging, self.transfers)
        self._clear(clears)

    def _clear(self, clears: Iterable[ClearRange]) -> None:
        """Zero the parts of a load's last attention blocks that the load did not fill."""
        for clear in clears:
            layout = self.layouts.get(clear.group)
            if layout is None:
                continue  # a pipeline stage holding no layer of this group
            assert isinstance(layout, AttentionGroupLayout)
            layout.zero(layout.token_index([clear.block_id], clear.first_token, clear.num_tokens))

    def worker_meta(self) -> OffloadWorkerMetadata | None:
        with self._lock:
            stored, self._stored = self._stored, {}
            samples, self._load_samples = self._load_samples, {}
            settled, self._settled = self._settled, []
        evicted = {}
        for name, backend in self.backends.items():
            if not backend.shared_index:
                keys = backend.take_evicted()
                if keys:
                    evicted[name] = keys
        meta = OffloadWorkerMetadata(stored=stored, evicted=evicted, load_samples=samples, settled=settled)
        return None if meta.is_empty() else meta

    # ---- helpers ----------------------------------------------------------------------
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

    def refresh_gauges(self) -> None:
        """Copy each backend's availability (as this process sees it) into the counters."""
        for name, tier in self.tiers.items():
            self.stats.update_backend(name, available=0 if tier.health.is_down else 1)

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._store_thread.is_alive():  # idempotent: a second call must not wait on the queue
            self.flush(timeout)
            self._store_queue.put(_STOP)
            self._store_thread.join(timeout)
        self._loader.shutdown(wait=True)
        self._switch.loading(False)
        for backend in self.backends.values():
            backend.close()
