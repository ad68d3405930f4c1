"""Scheduler side of the connector: decides what to load and what to store.

Runs in vLLM's scheduler (EngineCore) process, on the scheduler thread; nothing here is
thread-safe and nothing touches KV tensors. Lookups ask each backend which pages exist
(``contains_batch`` for backends whose index other processes see, a mirror fed by the
worker's reports otherwise), and the load policy (:mod:`.policy`) turns every backend's
presence into a :class:`~.policy.LoadChoice`: the prefix to load and each page's backend.

Loads are asynchronous (the request waits in WAITING_FOR_REMOTE_KVS while the worker reads;
pages missing in their backend are tried in the others), so a failed load is reported per
request and vLLM recomputes it. A lookup whose prefix is still being stored waits for it
(:mod:`.pending`). Stores are planned per step by :class:`~.store_plan.StorePlanner`; for
models with recurrent state the lookup also fixes where the request's prefill stops so that its
state can be stored (its tail, and the junction where earlier traffic shared more of the prefix
than any stored state covers; states every ``checkpoint_interval_tokens`` are taken where
steps end), which vLLM's scheduler asks through :meth:`OffloadScheduler.prefill_stop` (see
``engine/patches/prefill_stops``). A preempted request forgets its blocks and, when resumed, is
looked up again, so it loads what was offloaded before the preemption instead of recomputing it.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hybrid_offload.backends.base import BackendError
from hybrid_offload.connector.config import DEFAULT_ADAPTIVE_FORGET_S, Tier
from hybrid_offload.connector.metadata import (
    ClearRange,
    LoadJob,
    LoadSegment,
    OffloadMetadata,
    OffloadWorkerMetadata,
    PageJob,
    Promotion,
)
from hybrid_offload.connector.scheduler.backend_view import BackendView
from hybrid_offload.connector.scheduler.coverage import coverage
from hybrid_offload.connector.scheduler.events import TierEvents, published_medium
from hybrid_offload.connector.scheduler.extras import chunk_extras
from hybrid_offload.connector.scheduler.pending import DEFAULT_PENDING_STORE_WAIT_S, PendingStores
from hybrid_offload.connector.scheduler.policy import BackendMatch, LoadChoice, make_policy, presence_matrix
from hybrid_offload.connector.scheduler.request_state import (
    LoadEvent,
    LoadPhase,
    RequestState,
    extend_keys,
    page_job,
)
from hybrid_offload.connector.scheduler.scope import AdapterIdentities, ScopeError, request_scope
from hybrid_offload.connector.scheduler.sightings import ChunkSightings
from hybrid_offload.connector.scheduler.store_plan import StorePlanner
from hybrid_offload.core.drafting import Drafting
from hybrid_offload.core.kv_events import KVEventsSpec
from hybrid_offload.core.metrics import Locked, SchedulerCounters
from hybrid_offload.core.planner import HybridOffloadPlanner, LoadablePrefix
from hybrid_offload.core.spec import GroupKind

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

#: boundaries whose state pages a lookup asks first (then the rest, if none restores)
STATE_PROBES = 4

@functools.lru_cache(maxsize=256)
def _warn_no_cache(reason: str) -> None:
    """Once per reason (a waiting request is looked up at every step)."""
    logger.warning("requests skip the cache: %s", reason)


class OffloadScheduler:
    """Scheduler-side logic behind the connector facade."""

    def __init__(
        self,
        planner: HybridOffloadPlanner,
        backends: tuple[Tier, ...],
        load_policy: str = "weighted",
        *,
        adaptive_forget_s: float = DEFAULT_ADAPTIVE_FORGET_S,
        checkpoint_interval: int = 0,
        pending_wait_s: float = DEFAULT_PENDING_STORE_WAIT_S,
        accept_weights_version: bool = False,
        drafting: Drafting | None = None,
        events: KVEventsSpec | None = None,
        multimodal_keys: str = "content",
        clock: Callable[[], float] | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``drafting``: the engine's speculative decoding; ``events``: vLLM publishes KV events
        (then ours join them, :mod:`.events`); ``multimodal_keys``: what names an image in keys
        (:mod:`.extras`); ``timer`` times lookups (``lookup_seconds``)."""
        self.planner = planner
        self._timer = timer
        self._lookup_error_logged = False
        self._accept_weights_version = accept_weights_version
        self._multimodal_keys = multimodal_keys
        self.stats = Locked(SchedulerCounters())
        self.views = [BackendView(t, self.stats, i, clock or time.monotonic) for i, t in enumerate(backends)]
        self._by_name = {v.name: v for v in self.views}
        self._fallback_order = tuple(v.name for v in sorted(self.views, key=lambda v: -v.policy.load_weight))
        self.policy = make_policy(load_policy, planner, adaptive_forget_s)
        self._state_probes = 0 if self.policy.uses_presence else STATE_PROBES
        self._sightings = ChunkSightings()
        self.pending = PendingStores(pending_wait_s, clock) if clock else PendingStores(pending_wait_s)
        self.stores = StorePlanner(
            planner, self.views, self._sightings, self.pending, checkpoint_interval, drafting
        )
        self.events = None if events is None else TierEvents(
            planner, events, {v.name: v.shared for v in self.views},
            media={v.name: published_medium(v.tier.backend, v.shared) for v in self.views},
        )  # fmt: skip
        self.stores.events = self.events
        self._requests: dict[str, RequestState] = {}
        self._ended = OffloadMetadata()  # commits and releases of requests that ended since the last step
        self._epoch = ""  # weights epoch: a random nonce after each cache reset
        self._adapters = AdapterIdentities()
        weights = planner.spec.fingerprint_fields.get("model", {}).get("weights", {})
        #: why the weights are unbound (files changed after the engine started): no cache
        self._unbound: str = str(weights.get("unbound", "")) if isinstance(weights, dict) else ""

    # ---- lookup -----------------------------------------------------------------------
    def _request_state(self, request: Request) -> RequestState | None:
        """The request's state, keyed on first sight; a request keyed before a cache reset is
        keyed anew when it is looked up again (resumed), unless a load is in flight. None:
        the request does not use the cache (a malformed scope, an image that cannot be named)."""
        known = self._requests.get(request.request_id)
        in_flight = known is not None and known.load_phase in (LoadPhase.PENDING, LoadPhase.LOADING)
        if known is not None and (in_flight or not known.stale):
            return known
        if not self.planner.whole_model:
            _warn_no_cache("the other pipeline stages' layers are not known (their handshake did not arrive)")
            return None
        if self._unbound:
            _warn_no_cache(f"the weights are not bound to what this engine loaded: {self._unbound}")
            return None
        try:
            scope = request_scope(
                request, self._epoch, self._adapters, accept_version=self._accept_weights_version
            )
            extras = chunk_extras(request, self.planner.chunk_tokens, self._multimodal_keys)
        except ScopeError as exc:
            _warn_no_cache(str(exc))
            return None
        # as vLLM holds them: a position given as an embedding holds 0 (its key: ``extras``)
        prompt = list(request.all_token_ids[: request.num_prompt_tokens])
        seed = self.planner.scope_seed(scope)
        hashes = self.planner.chain(seed, prompt, extras)
        keys = self.planner.group_keys(hashes)
        state = RequestState(request, len(prompt), seed, hashes, keys, extras=extras)
        self._requests[request.request_id] = state
        self._sightings.see(hashes)
        if known is None:  # a request keyed anew after a reset is counted once
            aligned = self.planner.max_boundary_chunks(len(prompt)) * self.planner.chunk_tokens
            self.stats.add(requests=1, aligned_prompt_tokens=aligned)
        return state

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens loadable beyond ``num_computed_tokens`` as the load policy chooses; loads are
        async. None (vLLM asks again next step) while pages of this prefix are being stored. A
        resumed (preempted) request is looked up over its prompt and output so far. Timed
        (``lookups`` / ``lookup_seconds``: keying the request included). An unexpected error (a
        bug, ours or a backend's: not a :class:`BackendError`) is a miss, counted
        (``lookup_errors``) and logged with its traceback (the first; later ones at debug level,
        so a broken backend does not flood the log): it must not end the engine."""
        started = self._timer()
        try:
            return self._matched_tokens(request, num_computed_tokens)
        except Exception:
            log = logger.debug if self._lookup_error_logged else logger.error
            self._lookup_error_logged = True
            log("hybrid-offload: lookup of %s failed; a miss (later ones are logged at debug level)",
                request.request_id, exc_info=True)  # fmt: skip
            self.stats.add(lookup_errors=1)
            state = self._requests.get(request.request_id)
            if state is not None:  # whatever the failed lookup planned, no load
                state.choice, state.load_end, state.coverage = None, state.load_start, None
            return 0, False
        finally:
            elapsed = self._timer() - started
            self.stats.add(lookup_calls=1, lookup_seconds=elapsed)

    def _matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._request_state(request)
        if state is None or state.load_phase is not LoadPhase.IDLE:
            return 0, False
        num_tokens = max(state.prompt_len, request.num_tokens)
        if num_tokens > state.prompt_len:
            self._sightings.see(extend_keys(state, self.planner, num_tokens))
        start = num_computed_tokens // self.planner.chunk_tokens
        if self.pending.should_wait(state.req_id, (k for keys in state.keys for k in keys[start:])):
            return None, False
        self.pending.done_waiting(state.req_id)
        lookups = self._lookups(state, num_tokens, num_computed_tokens)
        matches = [m for m, _ in lookups]
        choice = self.policy.choose(matches, num_computed_tokens, num_tokens)
        state.choice, state.load_start = choice, num_computed_tokens
        self._plan_checkpoints(state, num_computed_tokens, choice, [r for _, r in lookups])
        if choice is None:
            return 0, False
        state.load_end = choice.end_tokens
        return choice.end_tokens - num_computed_tokens, True

    def _plan_checkpoints(
        self,
        state: RequestState,
        computed: int,
        choice: LoadChoice | None,
        results: list[LoadablePrefix | None],
    ) -> None:
        """Where the prefill stops to store states, and this lookup's coverage estimate."""
        chunk = self.planner.chunk_tokens
        served = choice.end_tokens if choice is not None else computed
        attention = max((r.attention_tokens for r in results if r is not None), default=0)
        shared = self._sightings.shared_chunks(state.chunk_hashes, computed // chunk) * chunk
        limit = self.planner.max_boundary_chunks(max(state.prompt_len, state.request.num_tokens)) * chunk
        attention, shared = min(attention, limit), min(shared, limit)
        reach = max(attention, shared)
        state.checkpoints = self.stores.checkpoints(state, reach if reach > served else 0)
        gap = max(attention, served) // chunk  # the first chunk no backend holds
        stored = gap < len(state.chunk_hashes) and self._sightings.was_stored(state.chunk_hashes[gap])
        down = any(r is None for r in results)
        state.coverage = coverage(computed, served, attention, shared, down, stored)

    def _lookups(
        self, state: RequestState, num_tokens: int, computed: int
    ) -> list[tuple[BackendMatch, LoadablePrefix | None]]:
        """Ask the tiers in order until the policy is settled: once a tier holds the whole
        prompt, later tiers that could not win are not asked (their lookups, hits and
        presence are then not counted for this request)."""
        chunks = min(self.planner.max_boundary_chunks(num_tokens), len(state.chunk_hashes))
        full = chunks * self.planner.chunk_tokens
        lookups: list[tuple[BackendMatch, LoadablePrefix | None]] = []
        for i, view in enumerate(self.views):
            rest = [(v.name, v.policy.load_weight) for v in self.views[i:]]
            if lookups and full > computed and self.policy.settled([m for m, _ in lookups], rest, full):
                break
            lookups.append(self._match(view, state, num_tokens, computed))
        return lookups

    def _match(
        self, view: BackendView, state: RequestState, num_tokens: int, computed: int
    ) -> tuple[BackendMatch, LoadablePrefix | None]:
        present: set[str] = set()
        layouts = state.layouts.setdefault(view.name, {})
        sets_contain = self.planner.sets_contain(state.keys, view.contains, layouts)

        def contains(keys: list[str]) -> list[bool]:
            answers = sets_contain(keys)
            present.update(k for k, hit in zip(keys, answers, strict=True) if hit)
            if self.events is not None and not view.is_down:
                self.events.looked_up(view.name, keys, answers)
            return answers

        k_max = min(self.planner.max_boundary_chunks(num_tokens), len(state.chunk_hashes))
        start = computed // self.planner.chunk_tokens
        try:
            result = self.planner.lookup(state.keys, contains, num_tokens, computed, self._state_probes)
        except BackendError:  # counted, and backed off, by the tier's wrappers
            return BackendMatch(view.name, view.policy.load_weight, 0, ()), None
        state.known_present.setdefault(view.name, set()).update(present)
        self._count_lookup(view.name, state, result.tokens, result.per_group_tokens)
        presence = presence_matrix(state.keys, present, k_max, start)
        match = BackendMatch(view.name, view.policy.load_weight, result.tokens, presence)
        return match, None if view.is_down else result  # still down: it was skipped

    def _count_lookup(self, name: str, state: RequestState, tokens: int, per_group: tuple[int, ...]) -> None:
        disagree = any(t != tokens for t in per_group)
        aligned = self.planner.max_boundary_chunks(state.prompt_len) * self.planner.chunk_tokens
        groups = {str(p.index): t for p, t in zip(self.planner.plans, per_group, strict=True)}
        disagreed = bool(disagree and tokens)
        self.stats.update(lambda c: c.record_lookup(name, tokens, aligned, groups, disagree=disagreed))
        if disagree and tokens and not state.warned_disagreement and not self.planner.has_state_groups:
            state.warned_disagreement = True
            logger.warning(
                "request %s: groups disagree on the loadable prefix in %s %s; loading %d tokens",
                state.req_id,
                name,
                list(per_group),
                tokens,
            )

    def prefill_stop(self, req_id: str, start: int, end: int, align: int = 1) -> int:
        """Where a step from ``start`` that vLLM would end at ``end`` must stop instead: in the
        prefill the request's first checkpoint strictly inside, else where a state between
        checkpoints is due (:meth:`StorePlanner.interval_stop`; ``align``: what vLLM's own
        steps end on); while decoding with drafts before a chunk boundary's last position
        (:meth:`StorePlanner.decode_stop`); else ``end``."""
        state = self._requests.get(req_id)
        if state is None:
            return end
        for stop in state.checkpoints:
            if start < stop < end:
                return stop
        stop = self.stores.interval_stop(state, start, end, align)
        return stop if stop != end else self.stores.decode_stop(state, start, end)

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        self._count_coverage(state, num_external_tokens)
        if num_external_tokens <= 0 or state.choice is None:
            return
        state.block_ids = [list(ids) for ids in block_ids]
        state.load_start = state.load_end - num_external_tokens
        state.on_load(LoadEvent.ADMITTED)
        choice = LoadChoice(state.load_start, state.load_end, state.choice.sources, state.choice.score)
        state.hit_tokens = choice.tokens_by_backend(self.planner)

    def _count_coverage(self, state: RequestState, num_external_tokens: int) -> None:
        """Once per admission: the last lookup's coverage (served as vLLM admitted it)."""
        cov = state.coverage
        if cov is None or state.coverage_counted:
            return
        state.coverage_counted = True
        if num_external_tokens != cov.served:  # vLLM trimmed the load, or a child connector serves it
            cov = state.coverage = cov.with_served(num_external_tokens)
        self.stats.update(lambda c: c.record_coverage(cov.served, cov.reusable, cov.lost))

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
        if state is None or state.choice is None or state.load_phase in (LoadPhase.LOADING, LoadPhase.FAILED):
            return 0.0
        return state.choice.score

    def drop_planned_load(self, req_id: str) -> None:
        """Forget the load planned for ``req_id`` (another source serves it)."""
        state = self._requests.get(req_id)
        if state is not None:
            state.choice, state.load_end = None, state.load_start
            state.on_load(LoadEvent.DROPPED)

    # ---- per-step metadata ----------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        meta, self._ended = self._ended, OffloadMetadata()
        meta.idle = not scheduler_output.num_scheduled_tokens
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self.handle_preemption(req_id, meta)
            meta.preempted.append(req_id)
        for pending in self._requests.values():
            if pending.load_phase is LoadPhase.PENDING:
                meta.loads.append(self._load_job(pending))
        model = self.planner.model
        foreign = any(p.layout for j in meta.loads for p in j.pages)
        if self.planner.spec.pp_size > 1 and model is not None and foreign:
            meta.model_layers = model.groups  # a stage reading another layout's parts needs them
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            self.stores.plan_step(
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
            self.stores.plan_step(
                state, cached.num_computed_tokens[i], scheduler_output.num_scheduled_tokens[req_id], meta
            )
        return meta

    def has_ended_work(self) -> bool:
        """Whether requests that ended left commits or releases for the next step, or (with KV
        events) stores whose reports are still to come: vLLM keeps stepping while this is true,
        so they do not wait for the next request (nor do a router's events)."""
        if self._ended.commits or self._ended.releases:
            return True
        return self.events is not None and self.pending.in_flight()

    def handle_preemption(self, req_id: str, meta: OffloadMetadata | None = None) -> None:
        """vLLM freed the request's blocks: what the worker holds for it is committed, and when
        it is scheduled again it is looked up anew (pages stored before the preemption load
        instead of being recomputed)."""
        self.stats.add(preemptions=1)
        state = self._requests.get(req_id)
        if state is not None:
            self.stores.finish(state, meta if meta is not None else self._ended)
            state.block_ids = []
            state.store_from_chunk = None
            state.next_store_chunk = 0
            state.coverage_counted = False

    def _load_job(self, state: RequestState) -> LoadJob:
        assert state.choice is not None
        chunk = self.planner.chunk_tokens
        start, end = state.load_start // chunk, state.load_end // chunk
        segments: dict[str, list[PageJob]] = {}
        clears: list[ClearRange] = []
        promotions: list[Promotion] = []
        for plan in self.planner.plans:
            for c in self.planner.needed_chunks(plan, end, start):
                source = state.choice.sources[(plan.index, c)]
                page = page_job(self.planner, state, plan, c, load_start=state.load_start)
                layout = state.layouts.get(source, {}).get(page.key)
                segments.setdefault(source, []).append(replace(page, layout=layout) if layout else page)
                promotion = None if layout else self.stores.promotion(state, page, source)
                if promotion is not None:
                    promotions.append(promotion)
            bs = plan.group.block_size
            if plan.kind is not GroupKind.MAMBA and state.load_end % bs:
                block = state.block_ids[plan.index][state.load_end // bs]
                clears.append(ClearRange(plan.index, block, state.load_end % bs, bs - state.load_end % bs))
        state.on_load(LoadEvent.SENT)
        state.store_from_chunk = end
        external = state.load_end - state.load_start
        self.stats.update(lambda c: c.record_planned_load(state.hit_tokens, external))
        return LoadJob(
            state.req_id,
            tuple(LoadSegment(name, tuple(pages)) for name, pages in segments.items()),
            self._fallback_order,
            tuple(clears),
            tuple(promotions),
        )

    # ---- worker feedback and request end ---------------------------------------------
    def update_connector_output(
        self, worker_meta: Any, finished_recving: set[str] | None, failed_recving: set[str] | None
    ) -> None:
        if isinstance(worker_meta, OffloadWorkerMetadata):
            for name, view in self._by_name.items():
                stored, evicted = worker_meta.stored.get(name, []), worker_meta.evicted.get(name, [])
                view.apply_report(stored, evicted)
                if self.events is not None:
                    self.events.stored(name, stored)
                    self.events.evicted(name, evicted)
            for name, samples in worker_meta.load_samples.items():
                for nbytes, seconds, ok in samples:
                    self.policy.observe(name, nbytes, seconds, ok)
            self.pending.settle(worker_meta.settled)
        for req_id in finished_recving or ():
            state = self._requests.get(req_id)
            if state is not None:
                state.on_load(LoadEvent.FINISHED)
        if failed_recving:
            self.stats.add(failed_loads=len(failed_recving))
            for req_id in failed_recving:
                state = self._requests.get(req_id)
                if state is not None:  # recompute from scratch, store good pages again
                    state.on_load(LoadEvent.FAILED)
                    state.store_from_chunk = None
                    state.known_present.clear()
                    state.layouts.clear()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; commit what the worker holds for it (with the next step). True
        while a load into its blocks is still in flight (vLLM then frees them when the worker
        reports that load finished); the request's coverage for ``kv_transfer_params``."""
        state = self._requests.pop(request.request_id, None)
        self.pending.done_waiting(request.request_id)
        if state is None:
            return False, None
        self.stores.finish(state, self._ended)
        report = {"hybrid_offload": state.coverage.as_dict()} if state.coverage is not None else None
        return state.loading, report

    def take_events(self) -> list[Any]:
        """KV events since the last call (:mod:`.events`); empty when events are off."""
        return [] if self.events is None else self.events.take()

    def refresh_gauges(self) -> None:
        """Copy each backend's availability (as this process sees it) and capacity into the
        counters; cheap, no backend call."""
        for view in self.views:
            available = 0 if view.is_down else 1
            self.stats.update_backend(
                view.name, available=available, capacity_bytes=view.tier.backend.capacity_bytes
            )

    def reset_cache(self) -> None:
        """Start a new weights epoch (after a weight update): requests from now on never match
        pages stored before, in this engine, after a restart or in another engine, unless they
        name a weights version. Requests keyed before store nothing more (what they computed
        may straddle the update; held copies are released) and are keyed anew when resumed.
        With KV events, every block published so far is removed."""
        self._epoch = os.urandom(16).hex()
        if self.events is not None:
            self.events.forget_all()
        self._sightings = ChunkSightings()
        self.stores.sightings = self._sightings
        for state in self._requests.values():
            state.stale = True
        logger.warning(
            "hybrid-offload cache reset: pages stored so far are no longer loaded (weights epoch %s)",
            self._epoch,
        )

    def shutdown(self) -> None:
        for view in self.views:
            view.close()
