"""Store planning: which pages each step copies out, which the worker holds, and when they commit.

Scheduler side, scheduler thread. Per scheduled request and step (``computed`` tokens before
it, ``scheduled`` in it, ``end = computed + scheduled`` after it):

* Attention: every chunk the step completes. Its key needs the chunk's token ids; under async
  scheduling the step's last input token may not be sampled yet when the step is planned, so
  such a chunk is copied now and *held* by the worker, then committed once its tokens are known
  (the next steps, or when the request ends) -- never lost when the request ends right after.
* Recurrent state (Mamba/GDN): vLLM holds it only at the end of a step. During the prefill it
  is stored when the step ends on one of the request's ``checkpoints`` (see
  :func:`~hybrid_offload.core.checkpoints.prefill_checkpoints`; the scheduler makes prefill steps stop
  there), and where a step ends on a chunk boundary ``checkpoint_interval_tokens`` or more
  past the last state (:meth:`StorePlanner.interval_stop` ends a step on one where vLLM would
  end it elsewhere, never adding a step where vLLM's steps end on block boundaries). During
  decoding, every step ending on a chunk boundary replaces the worker's held
  copy; the last one is committed when the request finishes or is preempted, so the next turn of
  a conversation, which repeats the reply, resumes at the end of it.
* Speculative decoding (:mod:`hybrid_offload.core.drafting`): a step's drafts may be rejected,
  so nothing past the known tokens is copied or held (attention chunks are copied once their
  tokens are known, a step or two later), and a decoding state is taken only after a step
  whose first input is the boundary's last position (:meth:`StorePlanner.decode_stop` ends the
  step before it), from the running state slot, where only the sampled token went in. That
  needs exact step positions and a state slot that is the request's own (Mamba cache mode
  other than ``align``); otherwise decoding states are not stored under drafting.
* When a request that stored pages ends, its pages are *touched* deepest first in every
  backend whose LRU refreshes (:class:`TouchJob`), after its stores: the prefix, which every
  deeper page needs, is then more recent than its extensions, also those stored by later turns
  of a conversation. A full backend evicts from the deep end of a chain, so a page is evicted
  only after every page that needs it, and the pages it leaves that can no longer load (the
  attention beyond the deepest state left) are the next to go.
* Output pages only for backends with ``store_output``; a chunk only once ``store_threshold``
  requests have seen it; never into ``read_only`` backends or pages a backend is known to hold.
* *Promotion*: a page a load reads from a tier is also put into the tiers it is to be stored
  in by the rules above that live in this engine's own memory (the cpu tier) and are faster
  (a higher ``load_weight``) than that tier, when their lookup did not find it
  (:meth:`StorePlanner.promotion`): the next hit of the prefix is served from there. The
  worker puts the bytes it read and checked, after the load; nothing waits for it.

Every store or commit sent to the workers is registered in :class:`PendingStores` until the
workers report it, so a lookup of the same prefix waits for it instead of missing it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hybrid_offload.connector.metadata import (
    CommitJob,
    OffloadMetadata,
    PageJob,
    Promotion,
    StoreJob,
    TouchJob,
)
from hybrid_offload.connector.scheduler.pending import PendingStores
from hybrid_offload.connector.scheduler.request_state import RequestState, extend_keys, page_job
from hybrid_offload.connector.scheduler.retention_hints import RetentionHints
from hybrid_offload.core.checkpoints import interval_stop, prefill_checkpoints, state_due
from hybrid_offload.core.drafting import Drafting, next_decode_stop
from hybrid_offload.core.planner import HybridOffloadPlanner
from hybrid_offload.core.spec import GroupKind

if TYPE_CHECKING:
    from hybrid_offload.connector.scheduler.backend_view import BackendView
    from hybrid_offload.connector.scheduler.events import TierEvents
    from hybrid_offload.connector.scheduler.sightings import ChunkSightings


class StorePlanner:
    """Emits store, hold and commit jobs into a step's metadata (see the module docstring)."""

    def __init__(
        self,
        planner: HybridOffloadPlanner,
        views: Sequence[BackendView],
        sightings: ChunkSightings,
        pending: PendingStores,
        checkpoint_interval: int = 0,
        drafting: Drafting | None = None,
    ) -> None:
        self.planner = planner
        self.drafting = drafting
        self.views = views
        self.sightings = sightings
        self.pending = pending
        #: KV events for the sets sent to tiers (None: the engine publishes no events)
        self.events: TierEvents | None = None
        self.hints = RetentionHints(planner)
        #: tiers of this engine's own memory (promotion targets) -> load weight; every tier's
        self._own_weights = {v.name: v.policy.load_weight for v in views if not v.shared}
        self._weights = {v.name: v.policy.load_weight for v in views}
        chunk = planner.chunk_tokens
        self.checkpoint_interval = -(-checkpoint_interval // chunk) * chunk if checkpoint_interval else 0
        writable = [v for v in views if not v.policy.read_only]
        self.stores_anything = bool(writable)
        self.stores_output = any(v.policy.store_output for v in writable)
        mamba = [p for p in planner.plans if p.kind is GroupKind.MAMBA]
        #: drafting: decoding states are taken after steps that start on a boundary's last position
        self.decode_stops = bool(
            drafting is not None and drafting.exact_steps and mamba and self.stores_output
            and all(p.unsplittable for p in mamba)
        )

    # ---- checkpoints ------------------------------------------------------------------
    def checkpoints(self, state: RequestState, junction: int = 0) -> tuple[int, ...]:
        """Where this request's prefill stops to store its state (none without state groups or
        writable backends). A resumed request's prefill also replays its output so far. With
        KV events, also at the last position they can name (:mod:`.events`)."""
        if not (self.planner.has_state_groups and self.stores_anything):
            return ()
        prefill_end = max(state.prompt_len, state.request.num_tokens - 1)
        named = self.events.block_tokens if self.events is not None else 0
        return tuple(prefill_checkpoints(prefill_end, self.planner.chunk_tokens, junction, named))

    def interval_stop(self, state: RequestState, start: int, end: int, align: int) -> int:
        """Where a prefill step over ``[start, end)`` ends so that the state at its end is due
        (see :func:`~hybrid_offload.core.checkpoints.interval_stop`; ``align``: what vLLM's own
        steps end on, 1 for any position); ``end`` when none is due or the prefill is past its
        tail."""
        checkpoints = state.checkpoints
        if not checkpoints or end > checkpoints[-1]:
            return end
        last = state.last_state if state.last_state is not None else start
        align = math.lcm(self.planner.chunk_tokens, align)
        return interval_stop(start, end, last, self.checkpoint_interval, align)

    def _state_due(self, state: RequestState, end: int) -> bool:
        """Whether the prefill state at ``end`` (a chunk boundary) is stored (see
        :func:`~hybrid_offload.core.checkpoints.state_due`)."""
        return state_due(end, state.checkpoints, state.last_state, self.checkpoint_interval)

    def decode_states_note(self) -> str:
        """Whether decoding states are stored under drafting, and if not why (for the log)."""
        mamba = [p for p in self.planner.plans if p.kind is GroupKind.MAMBA]
        if self.decode_stops:
            return "stored at chunk boundaries"
        if not mamba or not self.stores_output:
            return "none (no state groups, or no backend with store_output)"
        if self.drafting is not None and not self.drafting.exact_steps:
            return ("not stored: under async scheduling a step is planned before the previous "
                    "step's drafts are verified (a chat's next turn recomputes the reply)")
        return ("not stored: Mamba cache mode 'align' keeps draft states in shared slots "
                "(a chat's next turn recomputes the reply)")

    # ---- per step -----------------------------------------------------------------------
    def decode_stop(self, state: RequestState, start: int, end: int) -> int:
        """Where a decoding step over ``[start, end)`` must end under drafting so that a later
        step starts on a chunk boundary's last position (see the module docstring); ``end``
        when none applies."""
        if not self.decode_stops or state.stale or start < self._prefill_end(state):
            return end
        return next_decode_stop(start, end, self.planner.chunk_tokens)

    @staticmethod
    def _prefill_end(state: RequestState) -> int:
        return max(state.prompt_len, state.request.num_tokens - 1)

    def plan_step(self, state: RequestState, computed: int, scheduled: int, meta: OffloadMetadata) -> None:
        if state.loading or state.stale or not self.stores_anything:
            return
        chunk = self.planner.chunk_tokens
        if state.store_from_chunk is None:
            # A chunk partly covered by vLLM's local hit is still whole in the request's blocks.
            state.store_from_chunk = computed // chunk
            state.next_store_chunk = state.store_from_chunk
            state.last_state = computed
        fed = computed + scheduled
        # drafts: only known tokens have final KV
        end = fed if self.drafting is None else self.drafting.verified_end(fed, state.known_tokens)
        limit = end if self.stores_output else min(end, state.prompt_len)
        self.sightings.see(extend_keys(state, self.planner, limit))
        keyed = len(state.chunk_hashes)
        last_full = limit // chunk
        attention = [p for p in self.planner.plans if p.kind is not GroupKind.MAMBA]
        for c in range(max(state.next_store_chunk, state.store_from_chunk), last_full):
            if c < keyed:
                for plan in attention:
                    self._store(meta, state, page_job(self.planner, state, plan, c))
            elif attention:
                for plan in attention:
                    self._hold(meta, state, page_job(self.planner, state, plan, c, keyed=False))
                state.held_attention.add(c)
        state.next_store_chunk = max(state.next_store_chunk, last_full)
        self._commit_attention(state, meta)
        mamba = [p for p in self.planner.plans if p.kind is GroupKind.MAMBA]
        if not mamba:
            return
        in_prefill = end <= (state.checkpoints[-1] if state.checkpoints else 0)
        due = in_prefill and end % chunk == 0 and end <= limit and self._state_due(state, end)
        if due and end // chunk - 1 < keyed:
            if end // chunk > state.store_from_chunk:
                for plan in mamba:
                    job = page_job(self.planner, state, plan, end // chunk - 1)
                    if all(job.block_ids):
                        self._store(meta, state, job)
                state.last_state = end
            return
        boundary = self._decode_boundary(state, computed, fed, end, limit)
        if boundary and boundary // chunk > state.store_from_chunk:
            jobs = [page_job(self.planner, state, plan, boundary // chunk - 1, keyed=False) for plan in mamba]
            if all(all(job.block_ids) for job in jobs):
                for job in jobs:
                    self._hold(meta, state, job)
                state.held_state = boundary // chunk - 1

    def _decode_boundary(self, state: RequestState, computed: int, fed: int, end: int, limit: int) -> int:
        """The chunk boundary whose decoding state the running state slot holds after this step
        (fed up to ``fed``, its KV final up to ``end``), 0 if none: the step's end when it fed
        known tokens only; with drafts, ``computed + 1`` when the step starts on that boundary's
        last position (only its sampled token went in there, see the module docstring)."""
        if not self.stores_output or (self.drafting is not None and not self.decode_stops):
            return 0
        chunk = self.planner.chunk_tokens
        if fed == end and end % chunk == 0 and end <= limit:
            boundary = end
        elif self.drafting is not None and (computed + 1) % chunk == 0 and computed + 1 <= end:
            boundary = computed + 1
        else:
            return 0
        return boundary if boundary >= state.prompt_len else 0

    def finish(self, state: RequestState, meta: OffloadMetadata) -> None:
        """The request ends or is preempted: commit what the worker holds for it whose tokens
        are known (the decoding state only if every held attention chunk before it commits),
        and release the rest. A stale request (keyed before a cache reset) commits nothing."""
        if state.stale:
            state.held_attention.clear()
            state.held_state = None
            state.stored = False
            meta.releases.append(state.req_id)
            return
        self.sightings.see(extend_keys(state, self.planner, state.known_tokens))
        uncommitted = self._commit_attention(state, meta)
        c = state.held_state
        if c is not None and c < len(state.chunk_hashes) and not any(a <= c for a in uncommitted):
            for plan in self.planner.plans:
                if plan.kind is GroupKind.MAMBA:
                    self._commit(meta, state, page_job(self.planner, state, plan, c))
        state.held_attention.clear()
        state.held_state = None
        meta.releases.append(state.req_id)
        self._touch(state, meta)

    def _touch(self, state: RequestState, meta: OffloadMetadata) -> None:
        """Refresh the request's chain deepest first: every attention chunk, and the states it
        stored or loaded (per chunk the state before the attention). Other states on the chain
        are not needed by these pages and may age."""
        if not state.stored:
            return
        state.stored = False
        targets = tuple(
            v.name for v in self.views
            if v.touch_refreshes and not v.policy.read_only and not v.is_down
        )  # fmt: skip
        if not targets:
            return
        states = set(state.state_chunks)
        if state.load_end:
            states.add(state.load_end // self.planner.chunk_tokens - 1)
        mamba = [p for p in self.planner.plans if p.kind is GroupKind.MAMBA]
        attention = [p for p in self.planner.plans if p.kind is not GroupKind.MAMBA]
        pages = tuple(
            (state.keys[plan.index][c], plan.index)
            for c in reversed(range(len(state.chunk_hashes)))
            for plan in (mamba + attention if c in states else attention)
        )
        meta.touches.append(TouchJob(pages, targets))

    def _commit_attention(self, state: RequestState, meta: OffloadMetadata) -> list[int]:
        """Commit held attention chunks that are keyed now; the ones still not keyed."""
        waiting = []
        for c in sorted(state.held_attention):
            if c < len(state.chunk_hashes):
                for plan in self.planner.plans:
                    if plan.kind is not GroupKind.MAMBA:
                        self._commit(meta, state, page_job(self.planner, state, plan, c))
            else:
                waiting.append(c)
        state.held_attention = set(waiting)
        return waiting

    # ---- jobs ---------------------------------------------------------------------------
    def promotion(self, state: RequestState, page: PageJob, source: str) -> Promotion | None:
        """What a load reading ``page`` from ``source`` also puts into faster tiers of this
        engine's own memory (module docstring); None: nothing."""
        floor = self._weights[source]
        targets = tuple(t for t in self._targets(page, state) if self._own_weights.get(t, floor) > floor)
        if not targets:
            return None
        if self.events is not None:  # published once the worker reports it stored there
            self.events.planned(state, page, targets)
        return Promotion(page.key, page.group, targets, self.hints.for_loaded_page(state, page))

    def _targets(self, page: PageJob, state: RequestState) -> tuple[str, ...]:
        output = (page.chunk_index + 1) * self.planner.chunk_tokens > state.prompt_len
        seen = self.sightings.count(page.chunk_hash)
        return tuple(
            v.name
            for v in self.views
            if not v.policy.read_only
            and (v.policy.store_output or not output)
            and seen >= v.policy.store_threshold
            and page.key not in state.known_present.get(v.name, ())
            and not v.is_down
        )

    def _store(self, meta: OffloadMetadata, state: RequestState, page: PageJob) -> None:
        targets = self._targets(page, state)
        if targets:
            hint = self.hints.for_page(state, page)
            meta.stores.append(StoreJob(page, targets, state.req_id, retention=hint))
            self._stored(state, page, targets)

    def _stored(self, state: RequestState, page: PageJob, targets: tuple[str, ...]) -> None:
        self.pending.add(page.key, self.planner.writers(page.group))
        if self.events is not None:
            self.events.planned(state, page, targets)
        self.sightings.mark_stored(page.chunk_hash)
        state.stored = True
        if self.planner.plans[page.group].kind is GroupKind.MAMBA:
            state.state_chunks.add(page.chunk_index)

    def _hold(self, meta: OffloadMetadata, state: RequestState, page: PageJob) -> None:
        meta.stores.append(StoreJob(page, (), state.req_id, hold=True))

    def _commit(self, meta: OffloadMetadata, state: RequestState, page: PageJob) -> None:
        targets = self._targets(page, state)
        if targets:
            meta.commits.append(CommitJob(state.req_id, page, targets, self.hints.for_page(state, page)))
            self._stored(state, page, targets)
