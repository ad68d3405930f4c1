"""Scheduler side of the connector: decides what to load and what to store.

Runs in vLLM's scheduler (EngineCore) process, on the scheduler thread; nothing here is
thread-safe and nothing touches KV tensors. Lookups ask each backend which pages exist
(``contains_batch`` for backends whose index other processes see, a mirror fed by the
worker's reports otherwise), and the load policy (:mod:`.policy`) turns every backend's
presence into a :class:`~.policy.LoadChoice`: the prefix to load and each page's backend.

Loads are asynchronous (the request waits in WAITING_FOR_REMOTE_KVS while the worker reads;
pages missing in their backend are tried in the others), so a failed load is reported per
request and vLLM recomputes it. Stores are planned per step and per backend store policy: an
attention page as soon as its chunk is computed, a Mamba/GDN state page when a step ends
exactly on a chunk boundary (the only moment vLLM holds that state); output chunks only for
backends with ``store_output``; a chunk only once ``store_threshold`` requests have seen it.
A preempted request forgets its blocks and, when resumed, is looked up again, so it loads
what was offloaded before the preemption instead of recomputing it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybrid_offload.backends.base import Backend, BackendConfig, BackendError
from hybrid_offload.backends.registry import backend_class
from hybrid_offload.config import open_backend
from hybrid_offload.connector.health import BackendHealth
from hybrid_offload.connector.metadata import (
    LoadJob,
    LoadSegment,
    OffloadMetadata,
    OffloadWorkerMetadata,
    PageJob,
    StoreJob,
)
from hybrid_offload.connector.policy import BackendMatch, LoadChoice, make_policy, presence_matrix
from hybrid_offload.engine_spec import GroupKind
from hybrid_offload.metrics import Locked, SchedulerCounters
from hybrid_offload.planner import GroupPlan, HybridOffloadPlanner, chain_chunk_hashes

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

#: chunks whose sightings ``store_threshold`` remembers (LRU; ~100 bytes each)
MAX_TRACKED_CHUNKS = 1 << 18


class BackendView:
    """Answers ``contains`` for one backend from the scheduler process.

    A shared-index backend that fails is skipped (all misses) while its
    :class:`BackendHealth` backs off; the first lookup after the wait probes it again.
    """

    def __init__(self, config: BackendConfig, stats: Locked | None = None, index: int = 0) -> None:
        self.config = config
        self._stats = stats
        cls = backend_class(config.type)
        self.shared = cls.shared_index
        self.hit_source = cls.hit_source
        self._backend: Backend | None = open_backend(config, index) if self.shared else None
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
            if self._stats is not None:
                self._stats.record_error(self.name, "skipped")
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


class ChunkSightings:
    """How many requests saw each chunk (by chunk hash), for ``store_threshold``; LRU-bounded."""

    def __init__(self, capacity: int = MAX_TRACKED_CHUNKS) -> None:
        self._counts: OrderedDict[bytes, int] = OrderedDict()
        self._capacity = capacity

    def see(self, chunk_hashes: Iterable[bytes]) -> None:
        for h in chunk_hashes:
            self._counts[h] = self._counts.get(h, 0) + 1
            self._counts.move_to_end(h)
        while len(self._counts) > self._capacity:
            self._counts.popitem(last=False)

    def count(self, chunk_hash: bytes) -> int:
        return self._counts.get(chunk_hash, 0)


@dataclass
class RequestState:
    """What the scheduler side tracks per live request (``request`` is vLLM's, read-only)."""

    request: Request
    prompt_len: int
    seed: bytes
    chunk_hashes: list[bytes]
    keys: list[list[str]]
    block_ids: list[list[int]] = field(default_factory=list)
    choice: LoadChoice | None = None
    load_start: int = 0
    load_end: int = 0
    load_pending: bool = False
    loading: bool = False
    load_failed: bool = False
    hit_tokens: dict[str, int] = field(default_factory=dict)
    warned_disagreement: bool = False
    store_from_chunk: int | None = None
    next_store_chunk: int = 0
    known_present: dict[str, set[str]] = field(default_factory=dict)

    @property
    def req_id(self) -> str:
        return self.request.request_id


class OffloadScheduler:
    """Scheduler-side logic behind the connector facade."""

    def __init__(
        self,
        planner: HybridOffloadPlanner,
        backends: tuple[BackendConfig, ...],
        load_policy: str = "weighted",
    ) -> None:
        self.planner = planner
        self.stats = Locked(SchedulerCounters())
        self.views = [BackendView(c, self.stats, i) for i, c in enumerate(backends)]
        self._by_name = {v.name: v for v in self.views}
        self._fallback_order = tuple(v.name for v in sorted(self.views, key=lambda v: -v.config.load_weight))
        self.policy = make_policy(load_policy, planner)
        self._store_output = any(v.config.store_output for v in self.views)
        self._sightings = ChunkSightings()
        self._requests: dict[str, RequestState] = {}
        self._generation = 0

    # ---- lookup -----------------------------------------------------------------------
    def _request_state(self, request: Request) -> RequestState | None:
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return None
        prompt = list(request.prompt_token_ids or [])
        seed = self.planner.scope_seed(_request_scope(request, self._generation))
        hashes = chain_chunk_hashes(seed, prompt, self.planner.chunk_tokens)
        state = RequestState(request, len(prompt), seed, hashes, self.planner.group_keys(hashes))
        self._requests[request.request_id] = state
        self._sightings.see(hashes)
        with self.stats.lock:
            self.stats.counters.requests += 1
            self.stats.counters.aligned_prompt_tokens += (
                self.planner.max_boundary_chunks(len(prompt)) * self.planner.chunk_tokens
            )
        return state

    def _extend_keys(self, state: RequestState, num_tokens: int) -> None:
        """Key the chunks of the first ``num_tokens`` tokens beyond the prompt (output tokens)."""
        chunk = self.planner.chunk_tokens
        have = len(state.chunk_hashes)
        tokens = state.request.all_token_ids
        want = min(num_tokens, len(tokens)) // chunk
        if want <= have:
            return
        prev = state.chunk_hashes[-1] if have else state.seed
        new = chain_chunk_hashes(prev, list(tokens[have * chunk : want * chunk]), chunk)
        state.chunk_hashes.extend(new)
        for group_keys, more in zip(state.keys, self.planner.group_keys(new), strict=True):
            group_keys.extend(more)
        self._sightings.see(new)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens loadable beyond ``num_computed_tokens`` as the load policy chooses; loads are
        async. A resumed (preempted) request is looked up over its prompt and output so far."""
        state = self._request_state(request)
        if state is None or state.loading or state.load_failed or state.load_pending:
            return 0, False
        num_tokens = max(state.prompt_len, request.num_tokens)
        if num_tokens > state.prompt_len:
            self._extend_keys(state, num_tokens)
        matches = [self._match(view, state, num_tokens, num_computed_tokens) for view in self.views]
        choice = self.policy.choose(matches, num_computed_tokens, num_tokens)
        state.choice, state.load_start = choice, num_computed_tokens
        if choice is None:
            return 0, False
        state.load_end = choice.end_tokens
        return choice.end_tokens - num_computed_tokens, True

    def _match(self, view: BackendView, state: RequestState, num_tokens: int, computed: int) -> BackendMatch:
        present: set[str] = set()
        sets_contain = self.planner.sets_contain(state.keys, view.contains)

        def contains(keys: list[str]) -> list[bool]:
            answers = sets_contain(keys)
            present.update(k for k, hit in zip(keys, answers, strict=True) if hit)
            return answers

        k_max = min(self.planner.max_boundary_chunks(num_tokens), len(state.chunk_hashes))
        start = computed // self.planner.chunk_tokens
        try:
            result = self.planner.lookup(state.keys, contains, num_tokens, computed)
        except BackendError:
            with self.stats.lock:
                self.stats.counters.backend(view.name).unavailable += 1
            self.stats.record_error(view.name, "lookup")
            return BackendMatch(view.name, view.config.load_weight, 0, ())
        state.known_present.setdefault(view.name, set()).update(present)
        self._count_lookup(view.name, state, result.tokens, result.per_group_tokens)
        presence = presence_matrix(state.keys, present, k_max, start)
        return BackendMatch(view.name, view.config.load_weight, result.tokens, presence)

    def _count_lookup(self, name: str, state: RequestState, tokens: int, per_group: tuple[int, ...]) -> None:
        disagree = any(t != tokens for t in per_group)
        aligned = self.planner.max_boundary_chunks(state.prompt_len) * self.planner.chunk_tokens
        groups = {str(p.index): t for p, t in zip(self.planner.plans, per_group, strict=True)}
        with self.stats.lock:
            counters = self.stats.counters.backend(name)
            counters.record_lookup(tokens, aligned, groups)
            if disagree and tokens:
                self.stats.counters.group_disagreements += 1
        if disagree and tokens and not state.warned_disagreement:
            state.warned_disagreement = True
            logger.warning(
                "request %s: groups disagree on the loadable prefix in %s %s; loading %d tokens",
                state.req_id,
                name,
                list(per_group),
                tokens,
            )

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0 or state.choice is None:
            return
        state.block_ids = [list(ids) for ids in block_ids]
        state.load_start = state.load_end - num_external_tokens
        state.load_pending = True
        choice = LoadChoice(state.load_start, state.load_end, state.choice.sources, state.choice.score)
        state.hit_tokens = choice.tokens_by_backend(self.planner)

    def hit_sources(self, req_id: str) -> dict[str, int]:
        """Tokens of the planned load per hit source ("host", "disk", "p2p", ...)."""
        state = self._requests.get(req_id)
        out: dict[str, int] = {}
        for name, tokens in (state.hit_tokens if state is not None else {}).items():
            source = self._by_name[name].hit_source
            out[source] = out.get(source, 0) + tokens
        return out

    def load_score(self, req_id: str) -> float:
        """Score (tokens x weight) of the load planned by the last lookup of ``req_id``; 0.0 if
        none is planned (also while a load runs or after one failed: a stale plan must not win)."""
        state = self._requests.get(req_id)
        if state is None or state.choice is None or state.loading or state.load_failed:
            return 0.0
        return state.choice.score

    def drop_planned_load(self, req_id: str) -> None:
        """Forget the load planned for ``req_id`` (another source serves it)."""
        state = self._requests.get(req_id)
        if state is not None:
            state.choice, state.load_end, state.load_pending = None, state.load_start, False

    # ---- per-step metadata ----------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        meta = OffloadMetadata()
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self.handle_preemption(req_id)
            meta.preempted.append(req_id)
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

    def handle_preemption(self, req_id: str) -> None:
        """vLLM freed the request's blocks; when it is scheduled again, it is looked up anew
        (pages stored before the preemption load instead of being recomputed)."""
        with self.stats.lock:
            self.stats.counters.preemptions += 1
        state = self._requests.get(req_id)
        if state is not None:
            state.block_ids = []
            state.store_from_chunk = None
            state.next_store_chunk = 0

    def _load_job(self, state: RequestState) -> LoadJob:
        assert state.choice is not None
        chunk = self.planner.chunk_tokens
        start, end = state.load_start // chunk, state.load_end // chunk
        segments: dict[str, list[PageJob]] = {}
        for plan in self.planner.plans:
            for c in self.planner.needed_chunks(plan, end, start):
                page = self._page_job(plan, state, c, load_boundary=state.load_end)
                segments.setdefault(state.choice.sources[(plan.index, c)], []).append(page)
        state.load_pending = False
        state.loading = True
        state.store_from_chunk = end
        with self.stats.lock:
            for name, tokens in state.hit_tokens.items():
                self.stats.counters.backend(name).loaded_tokens += tokens
            self.stats.counters.external_tokens += state.load_end - state.load_start
        return LoadJob(
            state.req_id,
            tuple(LoadSegment(name, tuple(pages)) for name, pages in segments.items()),
            self._fallback_order,
        )

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
        state when the step ends exactly on a chunk boundary (output tokens only for backends
        with ``store_output``)."""
        if state.loading or not self.views:
            return
        chunk = self.planner.chunk_tokens
        if state.store_from_chunk is None:
            # A chunk partly covered by vLLM's local hit is still whole in the request's blocks.
            state.store_from_chunk = computed // chunk
            state.next_store_chunk = state.store_from_chunk
        limit = state.prompt_len
        if self._store_output and computed + scheduled > state.prompt_len:
            self._extend_keys(state, computed + scheduled)  # tokens not sampled yet stay unkeyed
            limit = max(limit, len(state.chunk_hashes) * chunk)
        after = min(computed + scheduled, limit)
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
        output = (page.chunk_index + 1) * self.planner.chunk_tokens > state.prompt_len
        seen = self._sightings.count(page.chunk_hash)
        targets = tuple(
            v.name
            for v in self.views
            if not v.config.read_only
            and (v.config.store_output or not output)
            and seen >= v.config.store_threshold
            and page.key not in state.known_present.get(v.name, ())
            and not v.health.is_down
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
            for name, samples in worker_meta.load_samples.items():
                for nbytes, seconds, ok in samples:
                    self.policy.observe(name, nbytes, seconds, ok)
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

    def refresh_gauges(self) -> None:
        """Copy each backend's availability (as this process sees it) and capacity into the
        counters; cheap, no backend call."""
        for view in self.views:
            available = 0 if view.health.is_down else 1
            self.stats.update_backend(
                view.name, available=available, capacity_bytes=view.config.capacity_bytes
            )

    def reset_cache(self) -> None:
        """Start a new key generation: requests from now on never match pages stored before
        (stale after a weight update). Requests already known keep their keys."""
        self._generation += 1
        self._sightings = ChunkSightings()
        logger.warning(
            "hybrid-offload cache reset: pages stored so far are no longer loaded (generation %d)",
            self._generation,
        )

    def shutdown(self) -> None:
        for view in self.views:
            view.close()


def _request_scope(request: Request, generation: int = 0) -> bytes:
    """Bytes that must scope keys beyond the tokens: LoRA adapter, cache salt, and the key
    generation after a cache reset."""
    parts = [f"gen:{generation}"] if generation else []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora:{lora.lora_name}:{lora.lora_int_id}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt:{salt}")
    return "\x1f".join(parts).encode()
