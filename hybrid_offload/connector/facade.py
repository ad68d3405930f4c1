"""The vLLM connector facade, exported by :mod:`hybrid_offload.connector`
(``kv_connector="HybridOffloadConnector"``).

A thin :class:`KVConnectorBase_V1` + :class:`SupportsHMA` that translates vLLM's config once,
then delegates every call to :class:`OffloadScheduler` (scheduler role) or
:class:`OffloadWorker` (worker role), and to the foreign child connectors of
``kv_connector_extra_config.connectors`` (:class:`ForeignConnectors`): our side first, then the
children in config order.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybrid_offload.compat import check_versions
from hybrid_offload.connector.children import (
    ForeignConnectors,
    HybridMetadata,
    HybridWorkerMetadata,
    choose_source,
    native_metadata,
    native_worker_metadata,
)
from hybrid_offload.connector.config import ROOT, ConfigError, parse_offload_config
from hybrid_offload.connector.metadata import OffloadMetadata
from hybrid_offload.connector.prometheus import HybridOffloadPromMetrics, HybridOffloadStats
from hybrid_offload.connector.scheduler import OffloadScheduler
from hybrid_offload.connector.worker import OffloadWorker
from hybrid_offload.core.metrics import StatsDelta
from hybrid_offload.core.planner import HybridOffloadPlanner, PlannerConfigError
from hybrid_offload.core.spec import UnidentifiableModelError
from hybrid_offload.core.tp_shards import ShardLayoutError
from hybrid_offload.engine.translate import model_spec_from_vllm

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _log_like_vllm() -> None:
    """Send hybrid_offload's log records where vLLM's go, unless the application set up ours."""
    package = logging.getLogger("hybrid_offload")
    vllm_logger = logging.getLogger("vllm")
    if package.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        package.addHandler(handler)
    package.setLevel(vllm_logger.level or logging.INFO)
    package.propagate = False


_log_like_vllm()

#: live connectors of this process, for in-process introspection (tests, demo, benchmarks)
ACTIVE_CONNECTORS: weakref.WeakSet[HybridOffloadConnector] = weakref.WeakSet()


class HybridOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """External KV cache for hybrid models: attention KV and Mamba/GDN state, many backends."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        check_versions("vllm", "prometheus_client")  # untested: a clear error, before anything
        super().__init__(vllm_config, role, kv_cache_config)
        config = parse_offload_config(self._kv_transfer_config.kv_connector_extra_config)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        try:
            spec = model_spec_from_vllm(
                vllm_config, kv_cache_config, config.tp_shards, config.model_version
            )
        except ShardLayoutError as exc:
            raise ConfigError(f"{ROOT}.tp_shards (tensor_parallel_size={tp_size}): {exc}") from exc
        except UnidentifiableModelError as exc:
            raise ConfigError(f"{ROOT}.model_version: {exc}") from exc
        try:
            self.planner = HybridOffloadPlanner(spec, config.chunk_tokens, config.chain_key)
        except PlannerConfigError as exc:
            raise ConfigError(f"{ROOT}.chunk_tokens: {exc}") from exc
        self.scheduler: OffloadScheduler | None = None
        self.worker: OffloadWorker | None = None
        self.children: ForeignConnectors | None = None
        if config.connectors:
            self.children = ForeignConnectors(config.connectors, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self._require_recompute_on_failure()
            self.scheduler = OffloadScheduler(
                self.planner,
                config.backends,
                config.load_policy,
                adaptive_forget_s=config.adaptive_forget_s,
                checkpoint_interval=config.checkpoint_interval_tokens,
                pending_wait_s=config.pending_store_wait_s,
                accept_weights_version=config.accept_weights_version,
            )
        else:
            self.worker = OffloadWorker(
                spec,
                self.planner,
                config.backends,
                config.max_pending_store_bytes,
                load_switch_interval_s=config.load_switch_interval_s,
                page_key=config.page_key,
            )
        side = self.scheduler or self.worker
        assert side is not None
        self._side = side
        self._stats_delta = StatsDelta(side.stats)
        ACTIVE_CONNECTORS.add(self)
        logger.debug("hybrid-offload fingerprint %s covers %s", spec.fingerprint, spec.fingerprint_fields)
        logger.info(
            "hybrid-offload %s (TP rank %d of %d): fingerprint=%s, chunk_tokens=%d, groups (kind, "
            "block, shards)=%s, backends=%s",
            role.name.lower(),
            spec.tp_rank,
            spec.tp_size,
            spec.fingerprint,
            self.planner.chunk_tokens,
            [(g.kind.value, g.block_size, g.shards) for g in spec.groups],
            [b.name for b in config.backends] + [c.name for c in config.connectors],
        )

    def _require_recompute_on_failure(self) -> None:
        """A cache miss at load time must mean recompute, never a failed request."""
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.info(
                "hybrid-offload sets kv_load_failure_policy=recompute (a failed cache "
                "load falls back to recomputation)"
            )
            self._kv_transfer_config.kv_load_failure_policy = "recompute"

    @property
    def requires_kv_delivery(self) -> bool:
        return self.children is not None and self.children.requires_kv_delivery

    def child_connectors(self) -> list[KVConnectorBase_V1]:
        """The foreign child connectors built from ``connectors`` (config order)."""
        return [] if self.children is None else list(self.children.connectors)

    # ---- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)
        if self.children is not None:
            self.children.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.children is not None:
            assert isinstance(connector_metadata, HybridMetadata)
            self.children.bind_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        if self.children is not None:
            self.children.clear_metadata()
        super().clear_connector_metadata()


    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = native_metadata(self._get_connector_metadata())
        assert self.worker is not None and isinstance(meta, OffloadMetadata)
        self.worker.start_loads(meta.loads)
        if self.children is not None:
            self.children.start_load_kv(forward_context, **kwargs)

    def handle_preemptions(self, preempted: Any) -> None:
        """Both vLLM signatures: ``(kv_connector_metadata)`` (vLLM >= 0.15) and
        ``(preempted_req_ids)`` (older; children then get the ids as they are)."""
        assert self.worker is not None
        if isinstance(preempted, KVConnectorMetadata):
            ours = native_metadata(preempted)
            assert isinstance(ours, OffloadMetadata)
            self.worker.handle_preemptions(ours.preempted)
            if self.children is not None:
                assert isinstance(preempted, HybridMetadata)
                self.children.handle_preemptions(preempted)
        elif isinstance(preempted, set | frozenset | list | tuple):
            self.worker.handle_preemptions(preempted)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.children is not None:
            self.children.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        if self.children is not None:
            self.children.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        meta = native_metadata(self._get_connector_metadata())
        assert self.worker is not None and isinstance(meta, OffloadMetadata)
        self.worker.save(meta)
        if self.children is not None:
            self.children.wait_for_save()

    def finish_forward(self) -> None:
        if self.children is not None:
            self.children.finish_forward()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's per-step report; completed loads are written into the KV cache first."""
        assert self.worker is not None
        recving, failed = self.worker.write_finished_loads()
        results = KVConnectorTransferResults(set(), recving, failed)
        if self.children is not None:
            theirs = self.children.transfer_results(finished_req_ids)
            results.finished_sending |= theirs.finished_sending
            results.finished_recving |= theirs.finished_recving
            results.failed_recving |= theirs.failed_recving
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self.children is None else self.children.block_ids_with_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def build_connector_worker_meta(self) -> Any:
        assert self.worker is not None
        ours = self.worker.worker_meta()
        if self.children is None:
            return ours
        meta = HybridWorkerMetadata(ours, self.children.worker_meta())
        return None if meta.is_empty() else meta

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None if self.children is None else self.children.handshake_metadata()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self.children is not None:
            self.children.set_xfer_handshake_metadata(metadata)

    def shutdown(self) -> None:
        try:
            if self.worker is not None:
                self.worker.shutdown()
            if self.scheduler is not None:
                self.scheduler.shutdown()
        finally:
            if self.children is not None:
                self.children.shutdown()

    # ---- metrics (both roles) ---------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This process's deltas since the previous call (None when nothing changed).

        vLLM calls it on the worker after every step (model-runner thread) and on the
        scheduler in ``update_from_output``, and aggregates the two. Never raises.
        """
        try:
            self._side.refresh_gauges()
            data = self._stats_delta.take()
        except Exception:
            logger.exception("hybrid-offload: taking connector stats failed")
            return None
        return HybridOffloadStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HybridOffloadStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return HybridOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        if self.children is None:
            return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        return choose_source(self.scheduler, self.children, request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks.get_block_ids(), num_external_tokens)
        if self.children is not None:
            self.children.update_state_after_alloc(request, blocks, num_external_tokens)

    def _native_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Tokens of our planned load per tier (cpu: host, disk: disk, nixl_peer: p2p)."""
        assert self.scheduler is not None
        if num_external_tokens <= 0:
            return {}
        sources = {CacheHitSource(k): v for k, v in self.scheduler.hit_sources(request.request_id).items()}
        if sum(sources.values()) != num_external_tokens:
            return {self._cache_hit_source: num_external_tokens}
        return {k: v for k, v in sources.items() if v}

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        theirs = None if self.children is None else self.children.loaded_group_ids(request)
        return self._kv_cache_config.transfer_group_ids if theirs is None else theirs

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        theirs = None
        if self.children is not None:
            theirs = self.children.cache_hit_sources(request, num_external_tokens)
        if theirs is None:
            return self._native_hit_sources(request, num_external_tokens)
        return theirs

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.children is not None:
            self.children.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        if self.children is not None:
            self.children.on_new_request(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        ours = self.scheduler.build_connector_meta(scheduler_output)
        if self.children is None:
            return ours
        theirs, extra_async_saves = self.children.build_meta(scheduler_output)
        return HybridMetadata(ours, theirs, extra_async_saves)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        worker_meta = connector_output.kv_connector_worker_meta
        self.scheduler.update_connector_output(
            native_worker_metadata(worker_meta),
            connector_output.finished_recving,
            connector_output.failed_recving,
        )
        if self.children is not None:
            theirs = worker_meta.children if isinstance(worker_meta, HybridWorkerMetadata) else None
            self.children.update_connector_output(connector_output, theirs)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        ours, report = self.scheduler.request_finished(request)
        if self.children is None:
            return ours, report
        delay, params = self.children.request_finished(request, block_ids)
        return ours or delay, _merge_params(report, params)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        ours, report = self.scheduler.request_finished(request)
        if self.children is None:
            return ours, report
        delay, params = self.children.request_finished_all_groups(request, block_ids)
        return ours or delay, _merge_params(report, params)

    def prefill_stop(self, request: Request, start: int, end: int) -> int:
        """Where a prefill step of ``request`` from ``start`` that vLLM would end at ``end``
        must end instead so that its recurrent state lands on a checkpoint (see
        ``engine/patches/prefill_stops``), ours or a child connector's; ``end`` when none lies
        strictly inside."""
        assert self.scheduler is not None
        end = self.scheduler.prefill_stop(request.request_id, start, end)
        return end if self.children is None else self.children.prefill_stop(request, start, end)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return () if self.children is None else self.children.take_events()

    def has_pending_block_frees(self) -> bool:
        return self.children is not None and self.children.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        """True while ended requests' held pages wait for a step to be committed, so that vLLM
        runs that step now rather than with the next request."""
        ours = self.scheduler is not None and self.scheduler.has_ended_work()
        return ours or (self.children is not None and self.children.has_pending_push_work())

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_external=True)`` (e.g. after a weight update): pages
        stored so far are never loaded by this engine again (new key generation); nothing is
        deleted, other engines sharing a tier keep theirs."""
        if self.scheduler is not None:
            self.scheduler.reset_cache()
        return True if self.children is None else self.children.reset_cache()


def _merge_params(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The request's ``kv_transfer_params``: the children's, plus our coverage report."""
    if ours is None or theirs is None:
        return theirs if ours is None else ours
    return {**theirs, **ours}


#: ``kv_connector: "MultiConnector"`` with this module path selects this connector too, so a vLLM
#: MultiConnector config switches to hybrid-offload by changing the module path.
MultiConnector = HybridOffloadConnector
