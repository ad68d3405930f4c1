"""Foreign child connectors: other connectors' ``kv_transfer_config``s listed under
``kv_connector_extra_config.connectors``, run next to the native backends.

One :class:`ForeignConnectors` per composition
(:class:`~hybrid_offload.connector.composite.HybridMultiConnector`) and role, built like vLLM's
MultiConnector builds its children: through ``KVConnectorFactory``, each with a shallow copy of
``vllm_config`` whose ``kv_transfer_config`` is the child's own. Scheduler side: every child is
asked for matches, and one source loads a request: the best score (tokens beyond the computed
ones x the child's ``load_weight``; ties to the earlier child; the native backends win a tie with
a child, see :func:`choose_source`). The others see the request's blocks with 0 external
tokens. Worker side: every hook reaches every child with its own slice of the metadata;
finished sets are unions. Our own metadata (the composition's facade's) travels next to the
children's in :class:`HybridMetadata` and :class:`HybridWorkerMetadata`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    supports_hma,
)

from hybrid_offload.connector.config import ROOT, ChildConnectorConfig, ConfigError

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


# ---- messages -----------------------------------------------------------------------------
@dataclass
class HybridMetadata(KVConnectorMetadata):
    """Scheduler -> worker of a composition: ours, then one entry per child (config order);
    ``extra_async_saves``: requests that more than one child saves asynchronously."""

    native: KVConnectorMetadata
    children: tuple[KVConnectorMetadata, ...]
    extra_async_saves: dict[str, int] | None = None


@dataclass
class HybridWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler of a composition: ours and one (optional) entry per child."""

    native: KVConnectorWorkerMetadata | None
    children: tuple[KVConnectorWorkerMetadata | None, ...]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, HybridWorkerMetadata) and len(other.children) == len(self.children)
        return HybridWorkerMetadata(
            _merge(self.native, other.native),
            tuple(_merge(a, b) for a, b in zip(self.children, other.children, strict=True)),
        )

    def is_empty(self) -> bool:
        native_empty = self.native is None or bool(getattr(self.native, "is_empty", lambda: False)())
        return native_empty and all(c is None for c in self.children)


def _merge(
    a: KVConnectorWorkerMetadata | None, b: KVConnectorWorkerMetadata | None
) -> KVConnectorWorkerMetadata | None:
    if a is None:
        return b
    return a if b is None else a.aggregate(b)


# ---- selection ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ChildMatch:
    """The best child for a lookup: ``index`` None when no child matched; ``tokens`` None when
    a child is still looking up (vLLM asks again later)."""

    index: int | None
    tokens: int | None
    is_async: bool = False
    score: float = 0.0


NO_MATCH = ChildMatch(None, 0)
PENDING = ChildMatch(None, None)


class NativeLoads(Protocol):
    """What :func:`choose_source` needs from the native side (OffloadScheduler)."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]: ...

    def load_score(self, req_id: str) -> float: ...

    def drop_planned_load(self, req_id: str) -> None: ...


def choose_source(
    native: NativeLoads, children: ForeignConnectors, request: Request, num_computed_tokens: int
) -> tuple[int | None, bool]:
    """Ask both sides, keep the better one's plan and return its answer for vLLM.

    The native side wins unless a child scores strictly higher; a pending child lookup makes
    the whole answer pending (None), like vLLM's MultiConnector.
    """
    native_answer = native.get_num_new_matched_tokens(request, num_computed_tokens)
    best = children.match(request, num_computed_tokens)
    req_id = request.request_id
    if best.tokens is None:
        native.drop_planned_load(req_id)
        children.select(req_id, None)
        return None, False
    if best.index is None or best.score <= native.load_score(req_id):
        children.select(req_id, None)
        return native_answer
    native.drop_planned_load(req_id)
    children.select(req_id, best.index)
    logger.debug(
        "request %s loads %d tokens from child %s (score %.1f)",
        req_id,
        best.tokens,
        children.configs[best.index].name,
        best.score,
    )
    return best.tokens, best.is_async


# ---- the children -------------------------------------------------------------------------
def _child_class(index: int, child: ChildConnectorConfig, defaults: dict[str, Any]) -> tuple[
        type[KVConnectorBase_V1], KVTransferConfig]:  # fmt: skip
    """The child's class and kv_transfer_config (``defaults`` under the child's own keys)."""
    try:
        transfer = KVTransferConfig(**{**defaults, **child.kv_transfer_config})
        cls = KVConnectorFactory.get_connector_class(transfer)
    except (ValueError, TypeError, AttributeError, ImportError) as exc:
        raise ConfigError(f"{ROOT}.connectors[{index}] ({child.name!r}): {exc}") from exc
    return cls, transfer


def _child_class_and_config(
    index: int, child: ChildConnectorConfig, vllm_config: VllmConfig
) -> tuple[type[KVConnectorBase_V1], VllmConfig]:
    """The child's class and a copy of ``vllm_config`` carrying the child's kv_transfer_config.

    ``kv_role`` and ``engine_id`` default to the parent's.
    """
    parent = vllm_config.kv_transfer_config
    assert parent is not None
    cls, transfer = _child_class(index, child, {"kv_role": parent.kv_role, "engine_id": parent.engine_id})
    child_config = copy.copy(vllm_config)
    child_config.kv_transfer_config = transfer
    return cls, child_config


def child_classes(configs: tuple[ChildConnectorConfig, ...]) -> list[type[KVConnectorBase_V1]]:
    """Each child's class, for the class-level hooks vLLM asks with no vllm_config (a child's
    role, when it states none, does not change its class)."""
    return [_child_class(i, c, {"kv_role": "kv_both"})[0] for i, c in enumerate(configs)]


def child_classes_and_configs(
    configs: tuple[ChildConnectorConfig, ...], vllm_config: VllmConfig
) -> list[tuple[type[KVConnectorBase_V1], VllmConfig]]:
    """Each child's class and its copy of ``vllm_config`` (see :func:`_child_class_and_config`)."""
    return [_child_class_and_config(i, c, vllm_config) for i, c in enumerate(configs)]


class ForeignConnectors:
    """The child connectors of one composition, for one role."""

    def __init__(
        self,
        configs: tuple[ChildConnectorConfig, ...],
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        """Build every child; raise ConfigError naming the child when it cannot be loaded, or
        lacks HMA support while the model has more than one KV cache group."""
        self.configs = configs
        groups = len(kv_cache_config.kv_cache_groups)
        resolved = child_classes_and_configs(configs, vllm_config)
        for index, (child, (cls, _)) in enumerate(zip(configs, resolved, strict=True)):
            if groups > 1 and not supports_hma(cls):
                raise ConfigError(
                    f"{ROOT}.connectors[{index}] ({child.name!r}): connector {cls.__name__} does not "
                    f"support vLLM's hybrid KV cache manager (it is no SupportsHMA), which this model "
                    f"needs ({groups} KV cache groups); remove it or use an HMA-capable connector"
                )
        self.connectors: list[KVConnectorBase_V1] = [
            cls(child_config, role, kv_cache_config) for cls, child_config in resolved
        ]
        self._selected: dict[str, int] = {}
        self._extra_async_saves: dict[str, int] = {}
        self.loaded_tokens: dict[str, int] = {c.name: 0 for c in configs}
        logger.info("hybrid-offload %s: child connectors %s", role.name.lower(), self.describe())

    def describe(self) -> list[tuple[str, str, float]]:
        """(name, class name, load weight) per child."""
        return [
            (cfg.name, type(c).__name__, cfg.load_weight)
            for cfg, c in zip(self.configs, self.connectors, strict=True)
        ]

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Per child name, the tokens it was chosen to load (plain data, for reports)."""
        return {name: {"loaded_tokens": n} for name, n in self.loaded_tokens.items()}

    @property
    def requires_kv_delivery(self) -> bool:
        return any(c.requires_kv_delivery for c in self.connectors)

    # ---- scheduler side ---------------------------------------------------------------
    def match(self, request: Request, num_computed_tokens: int) -> ChildMatch:
        """The child with the best score (ties to the earlier), NO_MATCH or PENDING."""
        best = NO_MATCH
        for index, (cfg, child) in enumerate(zip(self.configs, self.connectors, strict=True)):
            tokens, is_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if tokens is None:
                return PENDING
            score = tokens * cfg.load_weight
            if tokens > 0 and score > best.score:
                best = ChildMatch(index, tokens, is_async, score)
        return best

    def prefill_stop(self, request: Request, start: int, end: int, align: int = 1) -> int:
        """The earliest prefill stop any child asks for (a child that is our own connector
        names its checkpoints); ``end`` when none does."""
        for child in self.connectors:
            stop = getattr(child, "prefill_stop", None)
            if stop is not None:
                end = min(end, stop(request, start, end, align))
        return end

    def select(self, req_id: str, index: int | None) -> None:
        """Remember which child loads ``req_id`` (None: no child does)."""
        if index is None:
            self._selected.pop(req_id, None)
        else:
            self._selected[req_id] = index

    def selected(self, req_id: str) -> int | None:
        return self._selected.get(req_id)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """The selected child gets ``num_external_tokens``; every other child 0, all of them the
        request's real blocks (as vLLM 0.32's MultiConnector does)."""
        chosen = self._selected.get(request.request_id)
        for index, child in enumerate(self.connectors):
            count = num_external_tokens if index == chosen else 0
            child.update_state_after_alloc(request, blocks, count)
            if count > 0:
                self.loaded_tokens[self.configs[index].name] += count

    def loaded_group_ids(self, request: Request) -> tuple[int, ...] | None:
        """The selected child's loaded KV cache groups; None when no child loads the request."""
        chosen = self._selected.get(request.request_id)
        return None if chosen is None else self.connectors[chosen].get_loaded_kv_cache_group_ids(request)

    def cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int] | None:
        chosen = self._selected.get(request.request_id)
        if chosen is None:
            return None
        return self.connectors[chosen].get_external_cache_hit_sources(request, num_external_tokens)

    def build_meta(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[tuple[KVConnectorMetadata, ...], dict[str, int] | None]:
        """Every child's metadata for this step, and the extra async saves to pass on."""
        metas = tuple(c.build_connector_meta(scheduler_output) for c in self.connectors)
        extra, self._extra_async_saves = self._extra_async_saves or None, {}
        return metas, extra

    def update_connector_output(
        self, output: KVConnectorOutput, metas: tuple[KVConnectorWorkerMetadata | None, ...] | None
    ) -> None:
        """Give every child the step's output with its own worker metadata in it."""
        saved = output.kv_connector_worker_meta
        try:
            for index, child in enumerate(self.connectors):
                output.kv_connector_worker_meta = None if metas is None else metas[index]
                child.update_connector_output(output)
        finally:
            output.kv_connector_worker_meta = saved

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, lambda c: c.request_finished(request, block_ids))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """HMA children get every group; others (a one-group model) their only group."""

        def finish(child: KVConnectorBase_V1) -> tuple[bool, dict[str, Any] | None]:
            if supports_hma(child):
                return cast(SupportsHMA, child).request_finished_all_groups(request, block_ids)
            assert len(block_ids) == 1, "a non-HMA child with several KV cache groups"
            return child.request_finished(request, block_ids[0])

        return self._finished(request, finish)

    def _finished(
        self,
        request: Request,
        finish: Callable[[KVConnectorBase_V1], tuple[bool, dict[str, Any] | None]],
    ) -> tuple[bool, dict[str, Any] | None]:
        """Ask every child; True if any saves asynchronously; transfer params merged."""
        async_saves, params = 0, None
        for cfg, child in zip(self.configs, self.connectors, strict=True):
            delay, child_params = finish(child)
            async_saves += bool(delay)
            if child_params:
                clash: set[str] = set(params or {}) & set(child_params)
                if clash:
                    raise RuntimeError(f"child connector {cfg.name!r}: kv_transfer_params clash {clash}")
                params = {**(params or {}), **child_params}
        if async_saves > 1:
            self._extra_async_saves[request.request_id] = async_saves - 1
        self._selected.pop(request.request_id, None)
        return async_saves > 0, params

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        for child in self.connectors:
            child.bind_kv_cache_manager(manager)

    def on_new_request(self, request: Request) -> None:
        for child in self.connectors:
            child.on_new_request(request)

    def take_events(self) -> Iterable[Any]:
        for child in self.connectors:
            yield from child.take_events()

    def has_pending_block_frees(self) -> bool:
        return any(c.has_pending_block_frees() for c in self.connectors)

    def has_pending_push_work(self) -> bool:
        return any(c.has_pending_push_work() for c in self.connectors)

    def reset_cache(self) -> bool:
        return all([c.reset_cache() is not False for c in self.connectors])

    # ---- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for child in self.connectors:
            child.register_kv_caches(kv_caches)

    def bind_metadata(self, meta: HybridMetadata) -> None:
        if meta.extra_async_saves:
            self._extra_async_saves.update(meta.extra_async_saves)
        for child, child_meta in zip(self.connectors, meta.children, strict=True):
            child.bind_connector_metadata(child_meta)

    def clear_metadata(self) -> None:
        for child in self.connectors:
            child.clear_connector_metadata()

    def handle_preemptions(self, meta: HybridMetadata) -> None:
        for child, child_meta in zip(self.connectors, meta.children, strict=True):
            child.handle_preemptions(child_meta)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        for child in self.connectors:
            child.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for child in self.connectors:
            child.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        for child in self.connectors:
            child.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        for child in self.connectors:
            child.wait_for_save()

    def finish_forward(self) -> None:
        for child in self.connectors:
            child.finish_forward()

    def transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Union of the children's results; a request saved by n children is reported as
        finished sending once, when the last of them reports it."""
        results = KVConnectorTransferResults()
        for child in self.connectors:
            child_results = child.get_transfer_results(finished_req_ids)
            results.finished_recving |= child_results.finished_recving
            results.failed_recving |= child_results.failed_recving
            for req_id in child_results.finished_sending:
                pending = self._extra_async_saves.get(req_id, 0)
                if pending == 0:
                    results.finished_sending.add(req_id)
                elif pending == 1:
                    del self._extra_async_saves[req_id]
                else:
                    self._extra_async_saves[req_id] = pending - 1
        return results

    def bind_gpu_block_pool(self, pool: BlockPool) -> None:
        for child in self.connectors:
            child.bind_gpu_block_pool(pool)

    def register_finished_partial_tail(
        self, request: Request, block_ids: tuple[list[int], ...], offloads: list[tuple[int, int, int]]
    ) -> bool:
        """Every child is asked; True if any takes responsibility (as vLLM's MultiConnector)."""
        return any([c.register_finished_partial_tail(request, block_ids, offloads) for c in self.connectors])

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return all(c.supports_divergent_local_hybrid_hits for c in self.connectors)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        for child in self.connectors:
            child.set_host_xfer_buffer_ops(copy_operation)

    def reset_capture_state(self) -> None:
        for child in self.connectors:
            child.reset_capture_state()

    def mem_pool_contexts(self) -> list[tuple[str, AbstractContextManager]]:
        """(child name, context) of every child that provides a KV cache memory pool."""
        found = []
        for cfg, child in zip(self.configs, self.connectors, strict=True):
            context = child.get_mem_pool_context()
            if context is not None:
                found.append((cfg.name, context))
        return found

    def finished_counts(self) -> list[int | None]:
        return [c.get_finished_count() for c in self.connectors]

    def block_ids_with_load_errors(self) -> set[int]:
        failed: set[int] = set()
        for child in self.connectors:
            failed |= child.get_block_ids_with_load_errors()
        return failed

    def worker_meta(self) -> tuple[KVConnectorWorkerMetadata | None, ...]:
        return tuple(c.build_connector_worker_meta() for c in self.connectors)

    def handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """The first child's handshake metadata that is not None."""
        for child in self.connectors:
            meta = child.get_handshake_metadata()
            if meta is not None:
                return meta
        return None

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        for child in self.connectors:
            child.set_xfer_handshake_metadata(metadata)

    def shutdown(self) -> None:
        """Shut every child down; re-raise the last failure after trying all of them."""
        failure: Exception | None = None
        for cfg, child in zip(self.configs, self.connectors, strict=True):
            try:
                child.shutdown()
            except Exception as exc:  # every child gets its shutdown; the failure is re-raised
                logger.exception("child connector %s failed to shut down", cfg.name)
                failure = exc
        if failure is not None:
            raise failure
