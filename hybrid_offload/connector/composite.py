"""The composing connector, exported by :mod:`hybrid_offload.connector` as ``MultiConnector``
(``kv_connector="MultiConnector"`` with our module path: a vLLM MultiConnector config switches
to it by changing the module path).

It is :class:`~.facade.HybridOffloadConnector` (our backends, through the same scheduler and
worker) plus the foreign child connectors of ``kv_connector_extra_config.connectors``
(:class:`~.children.ForeignConnectors`): every hook runs our side first, then the children in
config order; one source loads a request (:func:`~.children.choose_source`). With no
``connectors`` it behaves as the plain facade. Our metadata travels next to the children's in
:class:`~.children.HybridMetadata` / :class:`~.children.HybridWorkerMetadata`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from hybrid_offload.connector.children import (
    ForeignConnectors,
    HybridMetadata,
    HybridWorkerMetadata,
    choose_source,
    native_metadata,
    native_worker_metadata,
)
from hybrid_offload.connector.config import parse_offload_config
from hybrid_offload.connector.facade import HybridOffloadConnector

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class MultiConnector(HybridOffloadConnector):
    """Our connector and the foreign child connectors of ``connectors``, composed."""

    composes_children = True

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        config = parse_offload_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        # children first: a child that cannot be built stops us before any backend is opened
        self.children: ForeignConnectors | None = None
        if config.connectors:
            self.children = ForeignConnectors(config.connectors, vllm_config, role, kv_cache_config)
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        except BaseException:
            if self.children is not None:
                self.children.shutdown()
            raise

    # ---- what the session harness inspects --------------------------------------------
    def child_connectors(self) -> list[KVConnectorBase_V1]:
        return [] if self.children is None else list(self.children.connectors)

    def counters(self) -> dict[str, Any]:
        counters = super().counters()
        if self.scheduler is not None and self.children is not None:
            counters["children"] = self.children.snapshot()
        return counters

    # ---- metadata: ours next to the children's ----------------------------------------
    def _offload_metadata(self) -> KVConnectorMetadata:
        return native_metadata(self._get_connector_metadata())

    @property
    def requires_kv_delivery(self) -> bool:
        """Whether a child hands off KV that must be delivered (ours never does)."""
        return self.children is not None and self.children.requires_kv_delivery

    # ---- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
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
        super().start_load_kv(forward_context, **kwargs)
        if self.children is not None:
            self.children.start_load_kv(forward_context, **kwargs)

    def handle_preemptions(self, preempted: Any) -> None:
        if isinstance(preempted, KVConnectorMetadata):
            super().handle_preemptions(native_metadata(preempted))
            if self.children is not None:
                assert isinstance(preempted, HybridMetadata)
                self.children.handle_preemptions(preempted)
        else:
            super().handle_preemptions(preempted)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.children is not None:
            self.children.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        if self.children is not None:
            self.children.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        super().wait_for_save()
        if self.children is not None:
            self.children.wait_for_save()

    def finish_forward(self) -> None:
        if self.children is not None:
            self.children.finish_forward()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        if self.children is not None:
            theirs = self.children.transfer_results(finished_req_ids)
            results.finished_sending |= theirs.finished_sending
            results.finished_recving |= theirs.finished_recving
            results.failed_recving |= theirs.failed_recving
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self.children is None else self.children.block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Any:
        ours = super().build_connector_worker_meta()
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
            super().shutdown()
        finally:
            if self.children is not None:
                self.children.shutdown()

    # ---- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.children is None:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        assert self.scheduler is not None
        return choose_source(self.scheduler, self.children, request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if self.children is not None:
            self.children.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        theirs = None if self.children is None else self.children.loaded_group_ids(request)
        return super().get_loaded_kv_cache_group_ids(request) if theirs is None else theirs

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        theirs = None
        if self.children is not None:
            theirs = self.children.cache_hit_sources(request, num_external_tokens)
        if theirs is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return theirs

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.children is not None:
            self.children.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        if self.children is not None:
            self.children.on_new_request(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        ours = super().build_connector_meta(scheduler_output)
        if self.children is None:
            return ours
        theirs, extra_async_saves = self.children.build_meta(scheduler_output)
        return HybridMetadata(ours, theirs, extra_async_saves)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        self._update_offload_output(connector_output, native_worker_metadata(worker_meta))
        if self.children is not None:
            theirs = worker_meta.children if isinstance(worker_meta, HybridWorkerMetadata) else None
            self.children.update_connector_output(connector_output, theirs)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        ours, report = super().request_finished(request, block_ids)
        if self.children is None:
            return ours, report
        delay, params = self.children.request_finished(request, block_ids)
        return ours or delay, _merge_params(report, params)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        ours, report = super().request_finished_all_groups(request, block_ids)
        if self.children is None:
            return ours, report
        delay, params = self.children.request_finished_all_groups(request, block_ids)
        return ours or delay, _merge_params(report, params)

    def prefill_stop(self, request: Request, start: int, end: int) -> int:
        end = super().prefill_stop(request, start, end)
        return end if self.children is None else self.children.prefill_stop(request, start, end)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return () if self.children is None else self.children.take_events()

    def has_pending_block_frees(self) -> bool:
        return self.children is not None and self.children.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        ours = super().has_pending_push_work()
        return ours or (self.children is not None and self.children.has_pending_push_work())

    def reset_cache(self) -> bool | None:
        ours = super().reset_cache()
        return ours if self.children is None else self.children.reset_cache()


def _merge_params(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The request's ``kv_transfer_params``: the children's, plus our coverage report."""
    if ours is None or theirs is None:
        return theirs if ours is None else ours
    return {**theirs, **ours}
