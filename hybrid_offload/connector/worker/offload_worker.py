"""Worker side of the connector: moves bytes between vLLM's KV cache and the backends.

A thin coordinator over two pipelines that share a :class:`~.context.WorkerContext`:

* :class:`~.store_pipeline.StorePipeline`: ``wait_for_save`` copies a step's pages out of the
  KV cache (model-runner thread); the store thread seals and puts them.
* :class:`~.load_pipeline.LoadPipeline`: the load thread reads and verifies pages and plans
  their writes; the model-runner thread writes them into the blocks vLLM allocated, between
  forwards, and reports the requests.
* :class:`~.device.DeviceTransfers`: the device of vLLM's KV cache (CPU, or CUDA with pinned
  pools, a load and a store stream); set when vLLM registers the cache.

Backends are the tiers' wrapped backends (:mod:`.tiers`): backoff after failures, timing and
error counting happen in the wrappers, so the pipelines only move bytes; a
:class:`~hybrid_offload.backends.base.BackendError` there means misses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import torch

from hybrid_offload.backends.base import BackendError
from hybrid_offload.connector.config import Tier
from hybrid_offload.connector.metadata import LoadJob, OffloadMetadata, OffloadWorkerMetadata, StoreJob
from hybrid_offload.connector.tiers import OpenTier, WorkerRecorder, open_tier, write_model_card
from hybrid_offload.connector.worker.context import WorkerContext
from hybrid_offload.connector.worker.device import DeviceTransfers
from hybrid_offload.connector.worker.load_pipeline import LoadPipeline, LoadRun
from hybrid_offload.connector.worker.memory_pool import LOAD_POOL_BYTES
from hybrid_offload.connector.worker.page_codec import PageCodec
from hybrid_offload.connector.worker.store_pipeline import StorePipeline
from hybrid_offload.core.layer_parts import ModelLayers
from hybrid_offload.core.metrics import Locked, WorkerCounters
from hybrid_offload.core.planner import HybridOffloadPlanner, LayerMapError
from hybrid_offload.core.spec import ModelSpec
from hybrid_offload.engine.kv_layout import AttentionGroupLayout, MambaGroupLayout, build_layouts

__all__ = ["LoadRun", "OffloadWorker"]

logger = logging.getLogger(__name__)


class OffloadWorker:
    """Worker-side logic behind the connector facade."""

    def __init__(
        self,
        spec: ModelSpec,
        planner: HybridOffloadPlanner,
        backends: tuple[Tier, ...],
        max_pending_store_bytes: int,
        *,
        max_held_bytes: int | None = None,
        load_switch_interval_s: float = 0.0,
        page_key: bytes | None = None,
        staging_pool_bytes: int = LOAD_POOL_BYTES,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``max_pending_store_bytes``: stores copied out and not yet stored; ``max_held_bytes``:
        copies held for requests (None: the same). ``page_key``: pages are signed with it and
        must verify under it (see ``page_format``).
        ``clock`` drives the backends' backoff; ``timer`` times the phases of loads;
        ``staging_pool_bytes``: free load staging memory kept for the next loads."""
        stats = Locked(WorkerCounters())
        recorder = WorkerRecorder(stats)
        self.tiers: dict[str, OpenTier] = {
            t.name: open_tier(t, i, recorder, clock) for i, t in enumerate(backends)
        }
        for t in backends:
            stats.update_backend(t.name, available=1, capacity_bytes=t.backend.capacity_bytes)
        codecs = {g.index: PageCodec(spec, g, planner.chunk_tokens) for g in spec.groups}
        self.ctx = WorkerContext(spec, planner, codecs, {n: t.backend for n, t in self.tiers.items()}, stats,
                                 page_key, timer)  # fmt: skip
        self.spec, self.planner, self.codecs, self.stats = spec, planner, codecs, stats
        self.backends = self.ctx.backends
        self._unpin: dict[str, Callable[[], object]] = {}
        held = max_pending_store_bytes if max_held_bytes is None else max_held_bytes
        self.stores = StorePipeline(self.ctx, max_pending_store_bytes, held)
        self.loads = LoadPipeline(self.ctx, staging_pool_bytes, load_switch_interval_s, self.stores.promote)
        threading.Thread(target=self._prepare_data_paths, name="hybrid-offload-prepare", daemon=True).start()

    @property
    def layouts(self) -> dict[int, AttentionGroupLayout | MambaGroupLayout]:
        return self.ctx.layouts

    @property
    def transfers(self) -> DeviceTransfers:
        return self.ctx.transfers

    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], attention_format: str | None = None,
        device_path: bool | None = None,
    ) -> None:  # fmt: skip
        """Address the tensors vLLM registered (``attention_format``: see ``build_layouts``) and
        move bytes to and from their device (``device_path``: see ``DeviceTransfers``)."""
        self.ctx.layouts = build_layouts(self.spec.groups, kv_caches, self.spec.num_blocks, attention_format)
        for group, layout in self.ctx.layouts.items():
            self.codecs[group].prepare(layout)
        devices = {t.device for t in kv_caches.values()}
        if len(devices) == 1:
            (device,) = devices
            if device != self.ctx.transfers.device or device_path is not None:
                self.ctx.transfers = DeviceTransfers(device, device_path)
                self.stores.use_device(self.ctx.transfers)
                self.loads.use_device(self.ctx.transfers)
                self._pin_arenas()

    def _pin_arenas(self) -> None:
        """Page-lock the arenas of the tiers that lend in place, once (CUDA), so that loads copy
        straight out of them and stores straight into them at the link's speed."""
        for name, backend in self.backends.items():
            if not self.ctx.transfers.is_cuda or not backend.in_place or name in self._unpin:
                continue
            started = time.monotonic()
            unpin = self.ctx.transfers.pin(backend.arena)  # type: ignore[attr-defined]
            if unpin is None:
                logger.warning("hybrid-offload: tier %s: its memory could not be page-locked; copies to "
                               "and from the GPU go through the driver's staging (slower)", name)  # fmt: skip
                continue
            self._unpin[name] = unpin
            logger.info("hybrid-offload: tier %s: %.1f GiB page-locked in %.1f s", name,
                        backend.arena.nbytes / 2**30, time.monotonic() - started)  # type: ignore[attr-defined]

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
            write_model_card(self.spec, self.planner.chunk_tokens, self.tiers, self.ctx.page_key)

    # ---- stores -----------------------------------------------------------------------
    def save(self, meta: OffloadMetadata) -> None:
        """``wait_for_save``: copy this step's pages out (stores and holds), commit held pages,
        drop what released requests still hold, then queue the recency refreshes."""
        self.stores.copy_out(meta.stores)
        self.stores.commit(meta.commits)
        for req_id in meta.releases:
            self.stores.release(req_id)
        for touch in meta.touches:
            self.stores.touch(touch)

    def copy_out(self, stores: list[StoreJob]) -> None:
        """See :meth:`StorePipeline.copy_out`."""
        self.stores.copy_out(stores)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until queued stores are written (used at shutdown and by tests)."""
        self.stores.flush(timeout)

    # ---- loads ------------------------------------------------------------------------
    def start_loads(
        self, loads: list[LoadJob], model_layers: tuple[tuple[str, ...], ...] | None = None
    ) -> None:
        """Start ``loads``; ``model_layers``: the whole model's layers per group, sent by the
        scheduler with loads of another layout's parts (a pipeline stage knows its own only)."""
        if model_layers is not None and self.planner.model is None:
            grid = self.spec.grid
            try:
                self.planner.set_model_layers(ModelLayers(grid.num_layers, model_layers, grid.indexed))
            except LayerMapError as exc:  # such loads then fail: recompute
                logger.warning("hybrid-offload: the model's layers sent by the scheduler do not fit: %s", exc)
        self.loads.start(loads)

    def write_finished_loads(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """See :meth:`LoadPipeline.write_finished`."""
        return self.loads.write_finished(wait_s)

    def handle_preemptions(self, req_ids: Iterable[str]) -> None:
        self.loads.handle_preemptions(req_ids)

    # ---- reports ----------------------------------------------------------------------
    def worker_meta(self) -> OffloadWorkerMetadata | None:
        report = self.ctx.outbox.take()
        evicted = {}
        for name, backend in self.backends.items():
            if not backend.shared_index:
                keys = backend.take_evicted()
                if keys:
                    evicted[name] = keys
        meta = OffloadWorkerMetadata(stored=report.stored, evicted=evicted, load_samples=report.samples,
                                     settled=report.settled)  # fmt: skip
        return None if meta.is_empty() else meta

    def refresh_gauges(self) -> None:
        """Copy each backend's availability (as this process sees it) into the counters."""
        for name, tier in self.tiers.items():
            self.stats.update_backend(name, available=0 if tier.health.is_down else 1)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Write the queued stores, stop the threads, close the backends (idempotent)."""
        if self.stores.running:
            self.flush(timeout)
        self.stores.shutdown(timeout)
        self.loads.shutdown()
        for unpin in self._unpin.values():
            unpin()
        self._unpin.clear()
        for backend in self.backends.values():
            backend.close()
