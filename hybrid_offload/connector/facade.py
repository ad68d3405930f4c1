"""The vLLM connector facade, exported by :mod:`hybrid_offload.connector`
(``kv_connector="HybridOffloadConnector"``).

A thin :class:`KVConnectorBase_V1` + :class:`SupportsHMA` that translates vLLM's config once,
then delegates every call to :class:`OffloadScheduler` (scheduler role) or
:class:`OffloadWorker` (worker role). It runs our backends only: foreign child connectors
(``kv_connector_extra_config.connectors``) are composed with it by
:class:`~hybrid_offload.connector.composite.HybridMultiConnector`.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybrid_offload.compat import check_versions
from hybrid_offload.connector.config import (
    ROOT,
    ConfigError,
    OffloadConfig,
    parse_offload_config,
    refuse_connectors,
)
from hybrid_offload.connector.metadata import OffloadMetadata, StageLayers
from hybrid_offload.connector.prometheus import HybridOffloadPromMetrics, HybridOffloadStats
from hybrid_offload.connector.scheduler.offload_scheduler import OffloadScheduler
from hybrid_offload.connector.tiers import write_model_card
from hybrid_offload.connector.worker.offload_worker import OffloadWorker
from hybrid_offload.core.budgets import host_memory_bytes, store_budgets
from hybrid_offload.core.layer_parts import LayerPartError
from hybrid_offload.core.metrics import StatsDelta
from hybrid_offload.core.planner import (
    GPU_HYBRID_ALIGNMENT,
    HybridOffloadPlanner,
    LayerMapError,
    PlannerConfigError,
    whole_model_layers,
)
from hybrid_offload.core.spec import ModelSpec, UnidentifiableModelError
from hybrid_offload.core.tp_shards import ShardLayoutError
from hybrid_offload.engine.multimodal import identifiers_name_content
from hybrid_offload.engine.translate import drafting_from_vllm, kv_events_from_vllm, model_spec_from_vllm

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
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def multimodal_keys(config: OffloadConfig, vllm_config: VllmConfig) -> str:
    """``config.multimodal_keys``, refused where it cannot name images safely: ``identifier``
    while vLLM's identifiers are per-process counters (prefix caching and its processor cache
    both off), which a restart gives to other images."""
    if config.multimodal_keys == "identifier" and not identifiers_name_content(vllm_config):
        raise ConfigError(
            f"{ROOT}.multimodal_keys: identifier needs vLLM's identifiers to name content, but with "
            "enable_prefix_caching off and mm_processor_cache_gb 0 vLLM numbers images per process; "
            "use content (the default)"
        )
    return config.multimodal_keys


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

#: live connectors of this process, facades and compositions (HybridMultiConnector), for
#: in-process introspection (tests, demo, benchmarks)
ACTIVE_CONNECTORS: weakref.WeakSet[KVConnectorBase_V1] = weakref.WeakSet()


class HybridOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """External KV cache for hybrid models: attention KV and Mamba/GDN state, many backends."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        *,
        config: OffloadConfig | None = None,
    ) -> None:
        """``config``: already parsed (a composition passes its own, without ``connectors``),
        or None: parsed from ``kv_connector_extra_config``. ``connectors`` is refused."""
        check_versions("vllm", what="HybridOffloadConnector")
        super().__init__(vllm_config, role, kv_cache_config)
        if config is None:
            config = parse_offload_config(self._kv_transfer_config.kv_connector_extra_config)
        refuse_connectors(config, "HybridOffloadConnector")
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        try:
            spec = model_spec_from_vllm(
                vllm_config, kv_cache_config, config.tp_shards, config.model_version, config.layer_parts
            )
        except ShardLayoutError as exc:
            raise ConfigError(f"{ROOT}.tp_shards (tensor_parallel_size={tp_size}): {exc}") from exc
        except UnidentifiableModelError as exc:
            raise ConfigError(f"{ROOT}.model_version: {exc}") from exc
        except LayerPartError as exc:
            raise ConfigError(f"{ROOT}.layer_parts: {exc}") from exc
        self.planner = self._planner(config, spec, vllm_config)
        self.scheduler: OffloadScheduler | None = None
        self.worker: OffloadWorker | None = None
        self._page_key = config.page_key
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
                drafting=drafting_from_vllm(vllm_config),
                events=kv_events_from_vllm(vllm_config, kv_cache_config, config.kv_events_token_ids),
                multimodal_keys=multimodal_keys(config, vllm_config),
            )
            self._log_drafting(self.scheduler)
        else:
            pending, held = self._store_budgets(config, spec, vllm_config)
            self.worker = OffloadWorker(
                spec,
                self.planner,
                config.backends,
                pending,
                max_held_bytes=held,
                load_switch_interval_s=config.load_switch_interval_s,
                page_key=config.page_key,
            )
        self._idle_load_wait_s = config.idle_load_wait_s
        side = self.scheduler or self.worker
        assert side is not None
        self._side = side
        self._stats_delta = StatsDelta(side.stats)
        ACTIVE_CONNECTORS.add(self)
        logger.debug("hybrid-offload fingerprint %s covers %s", spec.fingerprint, spec.fingerprint_fields)
        logger.info(
            "hybrid-offload %s (TP rank %d of %d, PP rank %d of %d): fingerprint=%s, chunk_tokens=%d, "
            "layer parts=%s, groups (kind, block, shards)=%s, backends=%s",
            role.name.lower(),
            spec.tp_rank,
            spec.tp_size,
            spec.pp_rank,
            spec.pp_size,
            spec.fingerprint,
            self.planner.chunk_tokens,
            spec.grid.layout,
            [(g.kind.value, g.block_size, g.shards) for g in spec.groups],
            [b.name for b in config.backends],
        )

    @staticmethod
    def _planner(config: OffloadConfig, spec: ModelSpec, vllm_config: VllmConfig) -> HybridOffloadPlanner:
        """The planner; on a GPU the default chunk of a hybrid model is the one every TP size
        shares (:data:`GPU_HYBRID_ALIGNMENT`)."""
        on_gpu = getattr(getattr(vllm_config, "device_config", None), "device_type", "") == "cuda"
        try:
            return HybridOffloadPlanner(spec, config.chunk_tokens, config.chain_key,
                                        GPU_HYBRID_ALIGNMENT if on_gpu else 0)  # fmt: skip
        except PlannerConfigError as exc:
            raise ConfigError(f"{ROOT}.chunk_tokens: {exc}") from exc

    def _store_budgets(
        self, config: OffloadConfig, spec: ModelSpec, vllm_config: VllmConfig
    ) -> tuple[int, int]:
        """(pending, held) store budgets: the configured ones, else sized from this rank's
        pages, vLLM's step and batch limits and (held copies) an eighth of the host's memory."""
        sched = vllm_config.scheduler_config
        sized = store_budgets(spec.groups, sched.max_num_batched_tokens, sched.max_num_seqs,
                              self.planner.chunk_tokens, host_memory_bytes() // 8)  # fmt: skip
        pending, held = config.max_pending_store_bytes, config.max_held_bytes
        pending = sized.pending if pending is None else pending
        held = sized.held if held is None else held
        logger.info("hybrid-offload worker: store budgets %.0f MiB in flight, %.0f MiB held (%s)",
                    pending / 2**20, held / 2**20, "configured or sized from the model's pages")  # fmt: skip
        return pending, held

    @staticmethod
    def _log_drafting(scheduler: OffloadScheduler) -> None:
        stores, drafting = scheduler.stores, scheduler.stores.drafting
        if drafting is None:
            return
        logger.info(
            "hybrid-offload: speculative decoding (%s, %d draft tokens%s): pages are copied only "
            "for accepted tokens; decoding states: %s", drafting.method, drafting.num_tokens,
            ", async scheduling" if drafting.async_scheduling else "", stores.decode_states_note(),
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
        """A best-effort cache: a dropped store is a future miss, nothing waits on delivery."""
        return False

    # ---- what the session harness inspects --------------------------------------------
    def nested_connectors(self) -> list[KVConnectorBase_V1]:
        """The connectors this one holds (none; a composition holds its parts)."""
        return []

    def counters(self) -> dict[str, Any]:
        """A snapshot of this process's side's counters (plain data)."""
        return self._side.stats.snapshot()

    # ---- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert self.worker is not None and isinstance(meta, OffloadMetadata)
        self.worker.start_loads(meta.loads, meta.model_layers)

    def handle_preemptions(self, preempted: Any) -> None:
        """Both vLLM signatures: ``(kv_connector_metadata)`` (vLLM >= 0.15) and
        ``(preempted_req_ids)`` (older)."""
        assert self.worker is not None
        if isinstance(preempted, OffloadMetadata):
            self.worker.handle_preemptions(preempted.preempted)
        elif isinstance(preempted, set | frozenset | list | tuple):
            self.worker.handle_preemptions(preempted)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole requests, written between steps

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # pages are copied out after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert self.worker is not None and isinstance(meta, OffloadMetadata)
        self.worker.save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's per-step report; completed loads are written into the KV cache first."""
        assert self.worker is not None
        meta = getattr(self, "_connector_metadata", None)  # this step's, still bound here
        idle = isinstance(meta, OffloadMetadata) and meta.idle
        recving, failed = self.worker.write_finished_loads(self._idle_load_wait_s if idle else 0.0)
        return KVConnectorTransferResults(set(), recving, failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def build_connector_worker_meta(self) -> Any:
        assert self.worker is not None
        return self.worker.worker_meta()

    # ---- pipeline stages' layers (vLLM's handshake metadata) ----------------------------
    def get_handshake_metadata(self) -> StageLayers | None:
        """Worker, pipeline-parallel engines only: this stage's layers per group."""
        spec = self.planner.spec
        if self.worker is None or spec.pp_size == 1:
            return None
        return StageLayers(spec.pp_rank, tuple(g.layer_names for g in spec.groups))

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Scheduler: every stage's layers, so that page sets cover the whole model. Until they
        are known (or if they do not fit together) requests skip the cache."""
        if self.scheduler is None or self.planner.whole_model:
            return
        stages: dict[int, Sequence[Sequence[str]]] = {
            m.pp_rank: m.groups for m in metadata.values() if isinstance(m, StageLayers)
        }
        try:
            model = whole_model_layers(self.planner.spec, stages)
            self.planner.set_model_layers(model, [stages[r] for r in sorted(stages)])
        except LayerMapError as exc:
            logger.error("hybrid-offload: the pipeline stages' layers do not fit together (%s); "
                         "requests skip the cache", exc)
            return
        logger.info("hybrid-offload: layers of %d pipeline stages known; pieces per group %s",
                    len(stages), [len(self.planner.pieces(p.index)) for p in self.planner.plans])
        # the model card (written by a PP=1 engine's worker): no stage can describe the model
        spec = self.planner.spec
        groups = tuple(dataclasses.replace(g, layer_names=model.groups[g.index]) for g in spec.groups)
        whole = dataclasses.replace(spec, groups=groups)
        assert self.scheduler is not None
        opened = {v.name: v.opened for v in self.scheduler.views if v.opened is not None}
        write_model_card(whole, self.planner.chunk_tokens, opened, self._page_key)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()

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
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """Tokens of our planned load per tier (cpu: host, disk: disk, nixl_peer: p2p)."""
        assert self.scheduler is not None
        if num_external_tokens <= 0:
            return {}
        sources = {CacheHitSource(k): v for k, v in self.scheduler.hit_sources(request.request_id).items()}
        if sum(sources.values()) != num_external_tokens:
            return {self._cache_hit_source: num_external_tokens}
        return {k: v for k, v in sources.items() if v}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """What our tiers gained and lost since the last call, as vLLM KV events (see
        :mod:`hybrid_offload.core.kv_events`); vLLM publishes them next to its own."""
        return self.scheduler.take_events() if self.scheduler is not None else ()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(
            connector_output.kv_connector_worker_meta,
            connector_output.finished_recving,
            connector_output.failed_recving,
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request)

    def prefill_stop(self, request: Request, start: int, end: int, align: int = 1) -> int:
        """Where a prefill step of ``request`` from ``start`` that vLLM would end at ``end``
        must end instead so that its recurrent state lands on a checkpoint (see
        ``engine/patches/prefill_stops``; ``align``: the positions vLLM's own steps end on);
        ``end`` when none lies strictly inside."""
        assert self.scheduler is not None
        return self.scheduler.prefill_stop(request.request_id, start, end, align)

    def has_pending_push_work(self) -> bool:
        """True while ended requests' held pages wait for a step to be committed, or (with KV
        events) stores wait for their reports, so that vLLM runs those steps now rather than
        with the next request."""
        return self.scheduler is not None and self.scheduler.has_ended_work()

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_external=True)`` (e.g. after a weight update): pages
        stored so far are never loaded by this engine again (new key generation); nothing is
        deleted, other engines sharing a tier keep theirs."""
        if self.scheduler is not None:
            self.scheduler.reset_cache()
        return True
