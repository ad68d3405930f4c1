"""Scheduler side of the connector: decides what to load and what to store.

Runs in vLLM's scheduler (EngineCore) process, on the scheduler thread; nothing here is
thread-safe and nothing touches KV tensors. Lookups ask each backend which pages exist
(``contains_batch`` for backends whose index other processes see, a mirror fed by the
worker's reports otherwise), the planner turns presence into the longest loadable prefix per
backend, and the best score (matched tokens x load weight; ties to the earlier backend) wins.

Loads are asynchronous (the request waits in WAITING_FOR_REMOTE_KVS while the worker reads),
so a failed load is reported per request and vLLM recomputes it. Stores are planned per step:
an attention page as soon as its chunk is computed, a Mamba/GDN state page when a step ends
exactly on a chunk boundary (the only moment vLLM holds that state).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybrid_offload.backends.base import Backend, BackendConfig, BackendError
from hybrid_offload.backends.registry import backend_class, create_backend
from hybrid_offload.connector.health import BackendHealth
from hybrid_offload.connector.metadata import (
    LoadJob,
    OffloadMetadata,
    OffloadWorkerMetadata,
    PageJob,
    StoreJob,
)
from hybrid_offload.engine_spec import GroupKind
from hybrid_offload.metrics import Locked, SchedulerCounters
from hybrid_offload.planner import GroupPlan, HybridOffloadPlanner

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class BackendView:
    """Answers ``contains`` for one backend from the scheduler process.

    A shared-index backend that fails is skipped (all misses) while its
    :class:`BackendHealth` backs off; the first lookup after the wait probes it again.
    """

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.shared = backend_class(config.type).shared_index
        self._backend: Backend | None = create_backend(config) if self.shared else None
        self._mirror: set[str] = set()
        self.health = BackendHealth(config.name, config.retry_after_s, config.retry_after_max_s)

    @property
    def name(self) -> str:
        return self.config.name

    def contains(self, keys: list[str]) -> list[bool]:
        """Presence per key; raises BackendError when the backend fails (after marking it down)."""
        if self._backend is None:
            return [k in self._mirror for k in keys]
        if not self.health.available():
            return [False] * len(keys)
        try:
            answers = self._backend.contains_batch(keys)
        except BackendError as exc:
            self.health.record_failure("lookup", exc)
            raise
        self.health.record_success()
        return answers

    def apply_report(self, stored: list[str], evicted: list[str]) -> None:
        if self._backend is None:
            # Stored first, then evicted: a key put and evicted since the last report is gone.
            # (A key evicted and put again is forgotten too: that costs a hit, never a bad load.)
            self._mirror.update(stored)
            self._mirror.difference_update(evicted)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()


@dataclass
class RequestState:
    """What the scheduler side tracks per live request."""

    req_id: str
    prompt_len: int
    chunk_hashes: list[bytes]
    keys: list[list[str]]
    block_ids: list[list[int]] = field(default_factory=list)
    load_backend: str | None = None
    load_start: int = 0
    load_end: int = 0
    load_pending: bool = False
    loading: bool = False
    load_failed: bool = False
    warned_disagreement: bool = False
    store_from_chunk: int | None = None
    next_store_chunk: int = 0
    known_present: dict[str, set[str]] = field(default_factory=dict)


class OffloadScheduler:
    """Scheduler-side logic behind the connector facade."""

    def __init__(self, planner: HybridOffloadPlanner, backends: tuple[BackendConfig, ...]) -> None:
        self.planner = planner
        self.views = [BackendView(c) for c in backends]
        self._by_name = {v.name: v for v in self.views}
        self._weights = {c.name: c.load_weight for c in backends}
        self._requests: dict[str, RequestState] = {}
        self.stats = Locked(SchedulerCounters())

    # ---- lookup -----------------------------------------------------------------------
    def _request_state(self, request: Request) -> RequestState | None:
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return None
        prompt = list(request.prompt_token_ids or [])
        hashes = self.planner.chunk_hashes(prompt, _request_scope(request))
        state = RequestState(request.request_id, len(prompt), hashes, self.planner.group_keys(hashes))
        self._requests[request.request_id] = state
        with self.stats.lock:
            self.stats.counters.requests += 1
            self.stats.counters.aligned_prompt_tokens += (
                self.planner.max_boundary_chunks(len(prompt)) * self.planner.chunk_tokens
            )
        return state

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens loadable beyond ``num_computed_tokens`` from the best backend; loads are async."""
        state = self._request_state(request)
        if state is None or state.loading or state.load_failed:
            return 0, False
        best_name, best_tokens, best_score = None, 0, 0.0
        for view in self.views:
            tokens = self._lookup(view, state, num_computed_tokens)
            score = tokens * self._weights[view.name]
            if tokens > num_computed_tokens and score > best_score:
                best_name, best_tokens, best_score = view.name, tokens, score
        state.load_backend, state.load_start, state.load_end = best_name, num_computed_tokens, best_tokens
        if best_name is None:
            return 0, False
        return best_tokens - num_computed_tokens, True

    def _lookup(self, view: BackendView, state: RequestState, num_computed_tokens: int) -> int:
        present: set[str] = state.known_present.setdefault(view.name, set())

        def contains(keys: list[str]) -> list[bool]:
            answers = view.contains(keys)
            present.update(k for k, hit in zip(keys, answers, strict=True) if hit)
            return answers

        try:
            result = self.planner.lookup(state.keys, contains, state.prompt_len, num_computed_tokens)
        except BackendError:
            with self.stats.lock:
                self.stats.counters.backend(view.name).unavailable += 1
            return 0
        with self.stats.lock:
            counters = self.stats.counters.backend(view.name)
            counters.lookups += 1
            counters.hit_tokens += result.tokens
            if result.groups_disagree and result.tokens:
                self.stats.counters.group_disagreements += 1
        if result.groups_disagree and result.tokens and not state.warned_disagreement:
            state.warned_disagreement = True
            logger.warning(
                "request %s: groups disagree on the loadable prefix in %s %s; loading %d tokens",
                state.req_id,
                view.name,
                list(result.per_group_tokens),
                result.tokens,
            )
        return result.tokens

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0 or state.load_backend is None:
            return
        state.block_ids = [list(ids) for ids in block_ids]
        state.load_start = state.load_end - num_external_tokens
        state.load_pending = True

    # ---- per-step metadata ----------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        meta = OffloadMetadata()
        for state in self._requests.values():
            if state.load_pending:
                meta.loads.append(self._load_job(state))
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            self._plan_stores(
                state, new.num_computed_tokens, scheduler_output.num_scheduled_tokens[new.req_id], meta
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_ids or ()]
                state.next_store_chunk = 0
            elif new_ids is not None:
                for group_ids, more in zip(state.block_ids, new_ids, strict=True):
                    group_ids.extend(more)
            self._plan_stores(
                state, cached.num_computed_tokens[i], scheduler_output.num_scheduled_tokens[req_id], meta
            )
        return meta

    def _load_job(self, state: RequestState) -> LoadJob:
        assert state.load_backend is not None
        chunk = self.planner.chunk_tokens
        start, end = state.load_start // chunk, state.load_end // chunk
        pages: list[PageJob] = []
        for plan in self.planner.plans:
            for c in self.planner.needed_chunks(plan, end, start):
                pages.append(self._page_job(plan, state, c, load_boundary=state.load_end))
        state.load_pending = False
        state.loading = True
        state.store_from_chunk = end
        with self.stats.lock:
            counters = self.stats.counters.backend(state.load_backend)
            counters.loaded_tokens += state.load_end - state.load_start
            self.stats.counters.external_tokens += state.load_end - state.load_start
        return LoadJob(state.req_id, state.load_backend, tuple(pages))

    def _page_job(
        self, plan: GroupPlan, state: RequestState, c: int, load_boundary: int | None = None
    ) -> PageJob:
        chunk = self.planner.chunk_tokens
        table = state.block_ids[plan.index]
        key, chunk_hash = state.keys[plan.index][c], state.chunk_hashes[c]
        if plan.kind is GroupKind.MAMBA:
            boundary = (c + 1) * chunk
            index = self.planner.mamba_state_block_index(plan, boundary)
            blocks = (table[index],)
            if load_boundary is not None:
                blocks = tuple(b for b in table[index:] if b)
            return PageJob(key, plan.index, c, chunk_hash, blocks)
        bs = plan.group.block_size
        first, last = c * chunk, (c + 1) * chunk - 1
        skip = max(0, state.load_start - first) if load_boundary is not None else 0
        return PageJob(
            key, plan.index, c, chunk_hash, tuple(table[first // bs : last // bs + 1]), first % bs, skip
        )

    def _plan_stores(self, state: RequestState, computed: int, scheduled: int, meta: OffloadMetadata) -> None:
        """Store pages that this step completes: attention chunks fully computed, and the Mamba
        state when the step ends exactly on a chunk boundary (prompt tokens only)."""
        if state.loading or not self.views:
            return
        chunk = self.planner.chunk_tokens
        if state.store_from_chunk is None:
            # A chunk partly covered by vLLM's local hit is still whole in the request's blocks.
            state.store_from_chunk = computed // chunk
            state.next_store_chunk = state.store_from_chunk
        after = min(computed + scheduled, state.prompt_len)
        first = max(state.next_store_chunk, state.store_from_chunk)
        last_full = after // chunk
        for c in range(first, last_full):
            for plan in self.planner.plans:
                if plan.kind is not GroupKind.MAMBA:
                    self._emit_store(meta, self._page_job(plan, state, c), state)
        if computed + scheduled == after and after % chunk == 0 and after // chunk > state.store_from_chunk:
            for plan in self.planner.plans:
                if plan.kind is GroupKind.MAMBA and after % plan.state_interval == 0:
                    job = self._page_job(plan, state, after // chunk - 1)
                    if all(job.block_ids):
                        self._emit_store(meta, job, state)
        state.next_store_chunk = max(state.next_store_chunk, last_full)

    def _emit_store(self, meta: OffloadMetadata, page: PageJob, state: RequestState) -> None:
        targets = tuple(
            v.name
            for v in self.views
            if page.key not in state.known_present.get(v.name, ()) and not v.health.is_down
        )
        if targets:
            meta.stores.append(StoreJob(page, targets))

    # ---- worker feedback and request end ---------------------------------------------
    def update_connector_output(
        self, worker_meta: Any, finished_recving: set[str] | None, failed_recving: set[str] | None
    ) -> None:
        if isinstance(worker_meta, OffloadWorkerMetadata):
            for name, view in self._by_name.items():
                view.apply_report(worker_meta.stored.get(name, []), worker_meta.evicted.get(name, []))
        for req_id in finished_recving or ():
            state = self._requests.get(req_id)
            if state is not None:
                state.loading = False
        if failed_recving:
            with self.stats.lock:
                self.stats.counters.failed_loads += len(failed_recving)
            for req_id in failed_recving:
                state = self._requests.get(req_id)
                if state is not None:  # recompute from scratch, store good pages again
                    state.load_failed = True
                    state.store_from_chunk = None
                    state.known_present.clear()

    def request_finished(self, request: Request) -> bool:
        """Forget the request; True while a load into its blocks is still in flight (vLLM then
        frees them when the worker reports that load finished)."""
        state = self._requests.pop(request.request_id, None)
        return state is not None and state.loading

    def shutdown(self) -> None:
        for view in self.views:
            view.close()

    def load_score(self, req_id: str) -> float:
        """Score of the load planned by the last lookup of ``req_id``: tokens beyond the computed
        ones x the backend's load weight; 0.0 when none is planned."""
        state = self._requests.get(req_id)
        if state is None or state.load_backend is None or state.loading or state.load_failed:
            return 0.0  # the last lookup returned 0 without planning anything
        return (state.load_end - state.load_start) * self._weights[state.load_backend]

    def drop_planned_load(self, req_id: str) -> None:
        """Forget the load planned for ``req_id`` (another source loads it instead), so that
        ``update_state_after_alloc`` does nothing for it."""
        state = self._requests.get(req_id)
        if state is not None:
            state.load_backend = None
            state.load_end = state.load_start


def _request_scope(request: Request) -> bytes:
    """Bytes that must scope keys beyond the tokens: LoRA adapter and cache salt."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora:{lora.lora_name}:{lora.lora_int_id}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt:{salt}")
    return "\x1f".join(parts).encode()
