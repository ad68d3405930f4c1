"""Minimal foreign connectors for tests, loaded by module path (``foreign_connectors``).

:class:`RecordingConnector` supports HMA and records each hook the first time a process calls
it (``<role> <hook>`` lines appended to ``kv_connector_extra_config.record_path``, when given).
It reports ``hit_tokens`` matches (default 0: never a hit; ``pending``: still looking up), with
``is_async``; its metadata
round-trips (``RecordingMetadata`` -> worker, ``RecordingWorkerMetadata`` -> scheduler) and the
receiving side records whether it got its own type (``bound-own-meta``, ``got-own-worker-meta``).
It never moves bytes: a test only lets it "load" where nothing checks the KV. The hooks vLLM's
MultiConnector forwards beyond those answer from the extra config too (``kvcache_layout``,
``piecewise``, ``mem_pool``, ``finished_count``, ``partial_tail``, ``divergent``).
:class:`NonHmaRecordingConnector` is the same without HMA support.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)


@dataclass
class RecordingMetadata(KVConnectorMetadata):
    step: int
    loads: dict[str, int] = field(default_factory=dict)


@dataclass
class RecordingWorkerMetadata(KVConnectorWorkerMetadata):
    steps: int = 1

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, RecordingWorkerMetadata)
        return RecordingWorkerMetadata(self.steps + other.steps)


class _Recording(KVConnectorBase_V1):
    """Records hooks; all behaviour comes from ``kv_connector_extra_config``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.record_path: str | None = extra.get("record_path")
        self.hit_tokens: int = int(extra.get("hit_tokens", 0))
        self.pending: bool = bool(extra.get("pending", False))
        self.is_async: bool = bool(extra.get("is_async", True))
        self.finished_sending: set[str] = set(extra.get("finished_sending", ()))
        self.async_save: bool = bool(extra.get("async_save", False))
        self.mem_pool = contextlib.nullcontext() if extra.get("mem_pool") else None
        self.finished_count: int | None = extra.get("finished_count")
        self.partial_tail: bool = bool(extra.get("partial_tail", False))
        self.divergent: bool = bool(extra.get("divergent", False))
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self._seen: set[str] = set()
        self._step = 0
        self._pending_loads: dict[str, int] = {}
        self._loading: set[str] = set()
        self.record("init")

    def record(self, hook: str, *args: Any) -> None:
        self.calls.append((hook, args))
        if self.record_path and hook not in self._seen:
            self._seen.add(hook)
            with open(self.record_path, "a") as f:
                f.write(f"{self.role.name.lower()} {hook} pid={os.getpid()}\n")

    # ---- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.record("get_num_new_matched_tokens", request.request_id, num_computed_tokens)
        if self.pending:
            return None, False
        return self.hit_tokens, self.is_async and self.hit_tokens > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.record("update_state_after_alloc", request.request_id, blocks, num_external_tokens)
        if num_external_tokens:
            self._pending_loads[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self.record("build_connector_meta")
        self._step += 1
        loads, self._pending_loads = self._pending_loads, {}
        return RecordingMetadata(self._step, loads)

    def update_connector_output(self, connector_output: Any) -> None:
        self.record("update_connector_output", connector_output.kv_connector_worker_meta)
        if isinstance(connector_output.kv_connector_worker_meta, RecordingWorkerMetadata):
            self.record("got-own-worker-meta")

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.record("request_finished", request.request_id)
        return self.async_save, None

    # ---- worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.record("register_kv_caches", len(kv_caches))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self.record("bind_connector_metadata", connector_metadata)
        if isinstance(connector_metadata, RecordingMetadata):
            self.record("bound-own-meta")
            self._loading.update(connector_metadata.loads)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self.record("clear_connector_metadata")
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.record("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.record("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.record("save_kv_layer", layer_name)

    def wait_for_save(self) -> None:
        self.record("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.record("get_finished", set(finished_req_ids))
        recving, self._loading = self._loading, set()
        sending = self.finished_sending & finished_req_ids
        self.finished_sending -= sending
        return sending or None, recving or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        self.record("build_connector_worker_meta")
        return RecordingWorkerMetadata()

    def shutdown(self) -> None:
        self.record("shutdown")

    # ---- hooks with defaults in vLLM's base class
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return vllm_config.kv_transfer_config.kv_connector_extra_config.get("kvcache_layout")

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return bool(extra_config.get("piecewise", False))

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self.divergent

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.record("bind_gpu_block_pool", gpu_block_pool)

    def register_finished_partial_tail(self, request: Any, block_ids: Any, offloads: Any) -> bool:
        self.record("register_finished_partial_tail", request.request_id)
        return self.partial_tail

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self.record("set_host_xfer_buffer_ops", copy_operation)

    def reset_capture_state(self) -> None:
        self.record("reset_capture_state")

    def get_mem_pool_context(self) -> Any:
        self.record("get_mem_pool_context")
        return self.mem_pool

    def get_finished_count(self) -> int | None:
        return self.finished_count


class RecordingConnector(_Recording, SupportsHMA):
    """The recording connector with HMA support."""

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.record("request_finished_all_groups", request.request_id, block_ids)
        return self.async_save, None


class NonHmaRecordingConnector(_Recording):
    """The recording connector without HMA support (no SupportsHMA)."""
