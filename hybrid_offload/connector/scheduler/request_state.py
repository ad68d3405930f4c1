"""What the scheduler side tracks per live request (shared by lookup and store planning)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from hybrid_offload.connector.metadata import PageJob
from hybrid_offload.connector.scheduler.coverage import Coverage
from hybrid_offload.connector.scheduler.policy import LoadChoice
from hybrid_offload.connector.scheduler.scope import session_hint
from hybrid_offload.core.planner import GroupPlan, HybridOffloadPlanner
from hybrid_offload.core.spec import GroupKind

if TYPE_CHECKING:
    from vllm.v1.request import Request


class LoadPhase(Enum):
    """Where a request's load stands. ``IDLE``: none in flight (a lookup may have planned one,
    ``RequestState.choice``); ``PENDING``: vLLM admitted it, the job is not sent yet;
    ``LOADING``: the worker has the job; ``FAILED``: a load failed, the request recomputes and
    never loads again."""

    IDLE = "idle"
    PENDING = "pending"
    LOADING = "loading"
    FAILED = "failed"


class LoadEvent(Enum):
    ADMITTED = "admitted"  # vLLM allocated blocks for the planned load
    DROPPED = "dropped"  # another source serves the request
    SENT = "sent"  # the load job went to the worker
    FINISHED = "finished"  # the worker wrote it into the KV cache
    FAILED = "failed"  # the worker could not (vLLM recomputes)


#: (event, phase) -> next phase; events not listed for a phase leave it as it is. A failure ends
#: loading whatever came before (vLLM may report a load finished and failed in one step).
_LOAD_TRANSITIONS: dict[tuple[LoadEvent, LoadPhase], LoadPhase] = {
    (LoadEvent.ADMITTED, LoadPhase.IDLE): LoadPhase.PENDING,
    (LoadEvent.DROPPED, LoadPhase.PENDING): LoadPhase.IDLE,
    (LoadEvent.SENT, LoadPhase.PENDING): LoadPhase.LOADING,
    (LoadEvent.FINISHED, LoadPhase.LOADING): LoadPhase.IDLE,
    **{(LoadEvent.FAILED, phase): LoadPhase.FAILED for phase in LoadPhase},
}


@dataclass
class RequestState:
    """One request as the scheduler side sees it (``request`` is vLLM's, read-only).

    Keys: ``chunk_hashes[c]`` and ``keys[group][c]`` cover the known full chunks of the prompt
    and, as they are generated, of the output. Loads: ``choice`` is the last lookup's plan,
    ``load_phase`` where its load stands (changed only by :meth:`on_load`).
    Stores: chunks below ``store_from_chunk`` are not stored (loaded, or vLLM's own hit);
    ``next_store_chunk`` is the first attention chunk not planned yet; ``checkpoints`` are the
    prefill positions where the prefill stops and its state is stored (``last_state``: the last
    state stored, for those taken between them); ``held_attention`` and
    ``held_state`` are the chunk indices whose pages the worker holds until they are committed;
    ``stored``: pages were sent to a backend since the request's chain was last touched;
    ``state_chunks``: the chunks whose state pages it sent. ``stale``: keyed before a cache
    reset (a weight update): it stores nothing more. ``extras``: per chunk index, what besides
    its tokens keys the chunk (its images and prompt embeddings: :mod:`.extras`).
    """

    request: Request
    prompt_len: int
    seed: bytes
    chunk_hashes: list[bytes]
    keys: list[list[str]]
    block_ids: list[list[int]] = field(default_factory=list)
    choice: LoadChoice | None = None
    load_start: int = 0
    load_end: int = 0
    load_phase: LoadPhase = LoadPhase.IDLE
    hit_tokens: dict[str, int] = field(default_factory=dict)
    warned_disagreement: bool = False
    store_from_chunk: int | None = None
    next_store_chunk: int = 0
    known_present: dict[str, set[str]] = field(default_factory=dict)
    #: per backend, the layout of each page set found in another layout than this engine's
    layouts: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)
    checkpoints: tuple[int, ...] = ()
    #: where the last state was stored in this prefill, or its start (None: not started)
    last_state: int | None = None
    held_attention: set[int] = field(default_factory=set)
    held_state: int | None = None
    stored: bool = False
    state_chunks: set[int] = field(default_factory=set)
    coverage: Coverage | None = None
    coverage_counted: bool = False
    stale: bool = False
    extras: dict[int, bytes] = field(default_factory=dict)

    def on_load(self, event: LoadEvent) -> LoadPhase:
        """Move ``load_phase`` as ``event`` says (:data:`_LOAD_TRANSITIONS`); the new phase."""
        self.load_phase = _LOAD_TRANSITIONS.get((event, self.load_phase), self.load_phase)
        return self.load_phase

    @property
    def loading(self) -> bool:
        """The worker has this request's load (vLLM must not free its blocks yet)."""
        return self.load_phase is LoadPhase.LOADING

    @property
    def req_id(self) -> str:
        return self.request.request_id

    @functools.cached_property
    def session(self) -> str | None:
        """The caller's session hint (:func:`~.scope.session_hint`), read once."""
        return session_hint(self.request)

    @property
    def known_tokens(self) -> int:
        """Tokens whose ids are known now (prompt and sampled output)."""
        return len(self.request.all_token_ids)


def extend_keys(state: RequestState, planner: HybridOffloadPlanner, num_tokens: int) -> list[bytes]:
    """Key the full chunks of the first ``num_tokens`` known tokens beyond those keyed (output
    tokens, or a resumed request's); returns the new chunk hashes."""
    chunk = planner.chunk_tokens
    have = len(state.chunk_hashes)
    tokens = state.request.all_token_ids
    want = min(num_tokens, len(tokens)) // chunk
    if want <= have:
        return []
    prev = state.chunk_hashes[-1] if have else state.seed
    new = planner.chain(prev, list(tokens[have * chunk : want * chunk]), state.extras, first=have)
    state.chunk_hashes.extend(new)
    for group_keys, more in zip(state.keys, planner.group_keys(new), strict=True):
        group_keys.extend(more)
    return new


def page_job(
    planner: HybridOffloadPlanner, state: RequestState, plan: GroupPlan, c: int, *,
    load_start: int | None = None, keyed: bool = True,
) -> PageJob:
    """Page set ``(c, plan's group)`` of ``state`` in its block table.

    Attention: the chunk's tokens (a load from ``load_start`` skips what vLLM holds). Mamba: the
    block holding the state at boundary ``(c + 1) * chunk``; a load writes every block from
    there on (vLLM may already have allocated the next running block). ``keyed=False`` leaves
    key and chunk hash empty (a held copy, keyed when committed).
    """
    chunk = planner.chunk_tokens
    table = state.block_ids[plan.index]
    key, chunk_hash = (state.keys[plan.index][c], state.chunk_hashes[c]) if keyed else ("", b"")
    if plan.kind is GroupKind.MAMBA:
        index = planner.mamba_state_block_index(plan, (c + 1) * chunk)
        blocks = (table[index],) if load_start is None else tuple(b for b in table[index:] if b)
        return PageJob(key, plan.index, c, chunk_hash, blocks)
    bs = plan.group.block_size
    first, last = c * chunk, (c + 1) * chunk - 1
    skip = max(0, load_start - first) if load_start is not None else 0
    blocks = tuple(table[first // bs : last // bs + 1])
    return PageJob(key, plan.index, c, chunk_hash, blocks, first % bs, skip)
