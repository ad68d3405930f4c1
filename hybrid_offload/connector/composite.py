"""The composing connector, exported by :mod:`hybrid_offload.connector`
(``kv_connector="HybridMultiConnector"``, or ``"MultiConnector"`` for configs written for
vLLM's MultiConnector).

One :class:`HybridOffloadConnector` (our backends, ``kv_connector_extra_config.backends``) and
the foreign child connectors of ``kv_connector_extra_config.connectors``
(:class:`ForeignConnectors`), run as vLLM's MultiConnector runs its children: every hook reaches
our side first, then the children in config order, each with its own slice of the metadata
(:class:`HybridMetadata` down, :class:`HybridWorkerMetadata` up). One source loads a request
(:func:`choose_source`: the best score, our backends winning a tie); finished sets are unions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from hybrid_offload.connector.children import (
    ForeignConnectors,
    HybridMetadata,
    HybridWorkerMetadata,
    child_classes,
    child_classes_and_configs,
    choose_source,
)
from hybrid_offload.connector.config import parse_offload_config
from hybrid_offload.connector.facade import ACTIVE_CONNECTORS, HybridOffloadConnector
from hybrid_offload.connector.metadata import StageLayers

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

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
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class HybridMultiConnector(KVConnectorBase_V1, SupportsHMA):
    """Our backends (a :class:`HybridOffloadConnector`, :attr:`native`) composed with foreign
    child connectors (:attr:`children`; none is fine: then it runs as the facade does)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        """Raise ConfigError naming the key when the config, a child or our side is unusable."""
        super().__init__(vllm_config, role, kv_cache_config)
        config = parse_offload_config(self._kv_transfer_config.kv_connector_extra_config)
        # children first: a child that cannot be built stops us before any backend is opened
        self.children = ForeignConnectors(config.connectors, vllm_config, role, kv_cache_config)
        try:
            self.native = HybridOffloadConnector(
                vllm_config, role, kv_cache_config, config=dataclasses.replace(config, connectors=())
            )
        except BaseException:
            self.children.shutdown()
            raise
        ACTIVE_CONNECTORS.add(self)

    @property
    def requires_kv_delivery(self) -> bool:
        return self.native.requires_kv_delivery or self.children.requires_kv_delivery

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        native, children = self.native, self.children
        return native.supports_divergent_local_hybrid_hits and children.supports_divergent_local_hybrid_hits

    # ---- class-level hooks (asked before any connector is built) ------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The layout our side or a child requires (None: any); ValueError where two differ
        (vLLM's MultiConnector's rule)."""
        assert vllm_config.kv_transfer_config is not None
        config = parse_offload_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        layouts = {HybridOffloadConnector.get_required_kvcache_layout(vllm_config)}
        for child, child_config in child_classes_and_configs(config.connectors, vllm_config):
            layouts.add(child.get_required_kvcache_layout(child_config))
        named = {layout for layout in layouts if layout is not None}
        if len(named) > 1:
            raise ValueError(f"KV cache layout mismatch: the connectors require {sorted(named)}; "
                             f"all connectors must use the same layout")  # fmt: skip
        return next(iter(named), None)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Whether our side or a child needs PIECEWISE CUDA graphs (layer-wise hooks)."""
        config = parse_offload_config(extra_config)
        if HybridOffloadConnector.requires_piecewise_for_cudagraph(extra_config):
            return True
        return any(
            child.requires_piecewise_for_cudagraph(dict(c.kv_transfer_config.get(EXTRA) or {}))
            for child, c in zip(child_classes(config.connectors), config.connectors, strict=True)
        )

    # ---- what the session harness inspects --------------------------------------------
    def nested_connectors(self) -> list[KVConnectorBase_V1]:
        """Our side, then the foreign children (config order)."""
        return [self.native, *self.children.connectors]

    def counters(self) -> dict[str, Any]:
        """Our side's counters; on the scheduler the tokens each child loaded under "children"."""
        counters = self.native.counters()
        if self.native.scheduler is not None:
            counters["children"] = self.children.snapshot()
        return counters

    # ---- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.native.register_kv_caches(kv_caches)
        self.children.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(connector_metadata, HybridMetadata)
        super().bind_connector_metadata(connector_metadata)
        self.native.bind_connector_metadata(connector_metadata.native)
        self.children.bind_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self.native.clear_connector_metadata()
        self.children.clear_metadata()
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.native.start_load_kv(forward_context, **kwargs)
        self.children.start_load_kv(forward_context, **kwargs)

    def handle_preemptions(self, preempted: Any) -> None:
        """Both vLLM signatures: ``(kv_connector_metadata)`` (vLLM >= 0.15; every child gets
        its own) and ``(preempted_req_ids)`` (older; our side only)."""
        if isinstance(preempted, HybridMetadata):
            self.native.handle_preemptions(preempted.native)
            self.children.handle_preemptions(preempted)
        else:
            self.native.handle_preemptions(preempted)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.native.wait_for_layer_load(layer_name)
        self.children.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        self.native.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        self.children.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.native.wait_for_save()
        self.children.wait_for_save()

    def finish_forward(self) -> None:
        self.native.finish_forward()
        self.children.finish_forward()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Ours (completed loads written into the KV cache first), united with the children's."""
        results = self.native.get_transfer_results(finished_req_ids)
        theirs = self.children.transfer_results(finished_req_ids)
        results.finished_sending |= theirs.finished_sending
        results.finished_recving |= theirs.finished_recving
        results.failed_recving |= theirs.failed_recving
        return results

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.native.get_block_ids_with_load_errors() | self.children.block_ids_with_load_errors()

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self.native.set_host_xfer_buffer_ops(copy_operation)
        self.children.set_host_xfer_buffer_ops(copy_operation)

    def reset_capture_state(self) -> None:
        self.native.reset_capture_state()
        self.children.reset_capture_state()

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        """The KV cache memory pool of the one side that provides one; ValueError where several
        do (the cache is allocated once, in one pool)."""
        found = self.children.mem_pool_contexts()
        ours = self.native.get_mem_pool_context()
        if ours is not None:
            found.insert(0, ("hybrid-offload", ours))
        if len(found) > 1:
            raise ValueError(f"several connectors provide a KV cache memory pool {[n for n, _ in found]}; "
                             "configure one on at most one connector")  # fmt: skip
        return found[0][1] if found else None

    def get_finished_count(self) -> int | None:
        """The count every side expects, None where one has none (vLLM's MultiConnector's
        rule); ValueError where two differ."""
        counts = [self.native.get_finished_count(), *self.children.finished_counts()]
        if any(c is None for c in counts):
            return None
        if len(set(counts)) > 1:
            raise ValueError(f"the connectors expect different finished counts: {sorted(set(counts))}")  # type: ignore[type-var]
        return counts[0]

    def build_connector_worker_meta(self) -> HybridWorkerMetadata | None:
        meta = HybridWorkerMetadata(self.native.build_connector_worker_meta(), self.children.worker_meta())
        return None if meta.is_empty() else meta

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Ours (a pipeline stage's layers) and the first child's that is not None, each
        delivered to its side (:class:`ComposedHandshake` where both have one)."""
        ours, theirs = self.native.get_handshake_metadata(), self.children.handshake_metadata()
        if ours is not None and theirs is not None:
            return ComposedHandshake(ours, theirs)
        return ours if ours is not None else theirs

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        ours, theirs = _split_handshakes(metadata)
        self.native.set_xfer_handshake_metadata(ours)
        self.children.set_xfer_handshake_metadata(theirs)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Every stage's layers to our side; the children's metadata to each child (as vLLM
        would give it to that child alone)."""
        ours, theirs = _split_handshakes(metadata)
        self.native.set_xfer_handshake_metadata_pp_aware(ours)
        for child in self.children.connectors:
            if theirs:
                child.set_xfer_handshake_metadata_pp_aware(theirs)

    def shutdown(self) -> None:
        """Our side, then every child (also when ours fails; a failure is re-raised)."""
        try:
            self.native.shutdown()
        finally:
            self.children.shutdown()

    # ---- metrics (both roles): ours ----------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.native.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HybridOffloadConnector.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return HybridOffloadConnector.build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    # ---- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Ask both sides; the better one's plan stands (:func:`choose_source`)."""
        assert self.native.scheduler is not None
        return choose_source(self.native.scheduler, self.children, request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Our side plans its load only if it was chosen; the chosen child gets the tokens,
        every other child 0."""
        self.native.update_state_after_alloc(request, blocks, num_external_tokens)
        self.children.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        theirs = self.children.loaded_group_ids(request)
        return self.native.get_loaded_kv_cache_group_ids(request) if theirs is None else theirs

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        theirs = self.children.cache_hit_sources(request, num_external_tokens)
        if theirs is None:
            return self.native.get_external_cache_hit_sources(request, num_external_tokens)
        return theirs

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Every side binds it (and with it its block pool) once, as vLLM's MultiConnector."""
        self.native.bind_kv_cache_manager(kv_cache_manager)
        self.children.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.native.bind_gpu_block_pool(gpu_block_pool)
        self.children.bind_gpu_block_pool(gpu_block_pool)

    def register_finished_partial_tail(
        self, request: Request, block_ids: tuple[list[int], ...], offloads: list[tuple[int, int, int]]
    ) -> bool:
        ours = self.native.register_finished_partial_tail(request, block_ids, offloads)
        theirs = self.children.register_finished_partial_tail(request, block_ids, offloads)
        return ours or theirs

    def on_new_request(self, request: Request) -> None:
        self.native.on_new_request(request)
        self.children.on_new_request(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        ours = self.native.build_connector_meta(scheduler_output)
        theirs, extra_async_saves = self.children.build_meta(scheduler_output)
        return HybridMetadata(ours, theirs, extra_async_saves)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Each side sees the step's output with its own worker metadata in it."""
        worker_meta = connector_output.kv_connector_worker_meta
        split = worker_meta if isinstance(worker_meta, HybridWorkerMetadata) else None
        connector_output.kv_connector_worker_meta = None if split is None else split.native
        try:
            self.native.update_connector_output(connector_output)
        finally:
            connector_output.kv_connector_worker_meta = worker_meta
        self.children.update_connector_output(connector_output, None if split is None else split.children)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        ours, report = self.native.request_finished(request, block_ids)
        delay, params = self.children.request_finished(request, block_ids)
        return ours or delay, _merge_params(report, params)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        ours, report = self.native.request_finished_all_groups(request, block_ids)
        delay, params = self.children.request_finished_all_groups(request, block_ids)
        return ours or delay, _merge_params(report, params)

    def prefill_stop(self, request: Request, start: int, end: int, align: int = 1) -> int:
        """The earliest prefill stop strictly inside ``(start, end)`` of ours and the children's
        (see ``engine/patches/prefill_stops``); ``end`` when there is none."""
        end = self.native.prefill_stop(request, start, end, align)
        return self.children.prefill_stop(request, start, end, align)

    def take_events(self) -> Iterable[KVCacheEvent]:
        yield from self.native.take_events()
        yield from self.children.take_events()

    def has_pending_block_frees(self) -> bool:
        return self.native.has_pending_block_frees() or self.children.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self.native.has_pending_push_work() or self.children.has_pending_push_work()

    def reset_cache(self) -> bool | None:
        """Ours (see :meth:`HybridOffloadConnector.reset_cache`), then every child's; False if
        a child reports a failed reset."""
        ours = self.native.reset_cache()
        theirs = self.children.reset_cache()
        return ours is not False and theirs


@dataclass(frozen=True)
class ComposedHandshake(KVConnectorHandshakeMetadata):
    """A worker's handshake metadata of both sides: ``ours`` (:class:`StageLayers`) and the
    children's."""

    ours: KVConnectorHandshakeMetadata
    children: KVConnectorHandshakeMetadata


_K = TypeVar("_K")
EXTRA = "kv_connector_extra_config"


def _split_handshakes(
    metadata: dict[_K, KVConnectorHandshakeMetadata],
) -> tuple[dict[_K, KVConnectorHandshakeMetadata], dict[_K, KVConnectorHandshakeMetadata]]:
    """(ours, the children's) of each worker's metadata."""
    ours: dict[_K, KVConnectorHandshakeMetadata] = {}
    theirs: dict[_K, KVConnectorHandshakeMetadata] = {}
    for key, meta in metadata.items():
        if isinstance(meta, ComposedHandshake):
            ours[key], theirs[key] = meta.ours, meta.children
        elif isinstance(meta, StageLayers):
            ours[key] = meta
        else:
            theirs[key] = meta
    return ours, theirs


def _merge_params(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The request's ``kv_transfer_params``: the children's, plus our coverage report."""
    if ours is None or theirs is None:
        return theirs if ours is None else ours
    return {**theirs, **ours}


#: ``kv_connector: "MultiConnector"`` with our module path selects this class, so a vLLM
#: MultiConnector config switches to hybrid-offload by changing the module path (vLLM's HMA
#: check for that name is answered by the ``hybrid_offload_multiconnector_hma`` patch).
MultiConnector = HybridMultiConnector
