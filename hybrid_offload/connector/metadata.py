"""Messages between the scheduler side and the worker side of the connector.

Scheduler -> worker: :class:`OffloadMetadata` (bound to every step). Worker -> scheduler:
:class:`OffloadWorkerMetadata` (returned with every step's output), and once at start-up
:class:`StageLayers` (vLLM's handshake metadata). All are plain data that vLLM carries between
processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybrid_offload.backends.retention import Retention
from hybrid_offload.compat import connector_metadata_bases

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
else:  # vLLM's classes, or stand-ins where vLLM is not installed (the data path runs without it)
    KVConnectorHandshakeMetadata, KVConnectorMetadata, KVConnectorWorkerMetadata = connector_metadata_bases()


@dataclass(frozen=True)
class StageLayers(KVConnectorHandshakeMetadata):
    """A pipeline stage's layers per KV cache group (in group order), sent by its workers once
    at start-up: the scheduler, which sees the first stage's only, learns the whole model's."""

    pp_rank: int
    groups: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class PageJob:
    """One (chunk, group) page to copy out of or into vLLM's KV cache.

    Attention groups: the chunk's tokens start ``first_token`` tokens into ``block_ids[0]``
    and continue through ``block_ids``; a load leaves the first ``skip_tokens`` tokens of the
    chunk alone (vLLM already holds them). Mamba groups: the state is read from
    ``block_ids[0]`` (store) or written into every block in ``block_ids`` (load).
    """

    key: str
    group: int
    chunk_index: int
    chunk_hash: bytes
    block_ids: tuple[int, ...]
    first_token: int = 0
    skip_tokens: int = 0
    #: a load: the layout (layer-part bounds) to read the set in; () this engine's own
    layout: tuple[int, ...] = ()


@dataclass(frozen=True)
class ClearRange:
    """Zero tokens ``[first_token, first_token + num_tokens)`` of attention block ``block_id`` in
    group ``group``: the part of a load's last block that the load does not fill. vLLM skips
    zeroing blocks a connector loads, and stale bytes there (e.g. a Mamba state's) can read as
    NaN in attention kernels that touch a whole tile."""

    group: int
    block_id: int
    first_token: int
    num_tokens: int


@dataclass(frozen=True)
class LoadSegment:
    """Pages to read from one backend."""

    backend: str
    pages: tuple[PageJob, ...]


@dataclass(frozen=True)
class Promotion:
    """After a load, put page set ``key`` (KV cache group ``group``), the bytes read and
    checked, into ``backends`` too: faster tiers of this engine's own memory that lack it."""

    key: str
    group: int
    backends: tuple[str, ...]
    retention: Retention | None = None


@dataclass(frozen=True)
class LoadJob:
    """Load the pages of request ``req_id``: each segment from its backend; a page missing or
    bad there is tried in the ``fallbacks`` backends, in order, before the load fails. Once the
    load succeeded, the worker puts the pages named in ``promotions`` into their tiers (best
    effort, in background)."""

    req_id: str
    segments: tuple[LoadSegment, ...]
    fallbacks: tuple[str, ...] = ()
    clears: tuple[ClearRange, ...] = ()
    promotions: tuple[Promotion, ...] = ()

    @property
    def pages(self) -> tuple[PageJob, ...]:
        return tuple(p for s in self.segments for p in s.pages)


@dataclass(frozen=True)
class StoreJob:
    """Copy ``page`` out of the KV cache now and put it into ``backends`` (in background).

    With ``hold``, the copy is kept by the worker under ``(req_id, group, chunk_index)`` until a
    :class:`CommitJob` stores it (its key is not known yet, or only the request's last one of
    its kind is worth storing); a later held state of the same request and group replaces it.
    """

    page: PageJob
    backends: tuple[str, ...]
    req_id: str = ""
    hold: bool = False
    #: what the page is for, told to the backends before it is put (their eviction policy)
    retention: Retention | None = None


@dataclass(frozen=True)
class CommitJob:
    """Store the page held for ``(req_id, page.group, page.chunk_index)`` under ``page``'s key."""

    req_id: str
    page: PageJob
    backends: tuple[str, ...]
    retention: Retention | None = None


@dataclass(frozen=True)
class TouchJob:
    """After the stores queued before it, refresh ``pages`` ((key, group) page sets, oldest
    first) in ``backends``: a backend's LRU then evicts them in that order."""

    pages: tuple[tuple[str, int], ...]
    backends: tuple[str, ...]


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    """This step's work for the worker side."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    commits: list[CommitJob] = field(default_factory=list)
    #: requests whose held copies are dropped after this step's commits
    releases: list[str] = field(default_factory=list)
    touches: list[TouchJob] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    #: no token is scheduled this step (the engine only waits, e.g. for loads): the worker
    #: may block briefly on its loads instead of returning at once (see ``idle_load_wait_s``)
    idle: bool = False
    #: the whole model's layers per group, for pipeline stages reading another layout's parts
    #: (sent with the loads that do)
    model_layers: tuple[tuple[str, ...], ...] | None = None


#: one measured load call: (bytes read, seconds, succeeded)
LoadSample = tuple[int, float, bool]


@dataclass
class OffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Per backend since the last report: the keys stored and evicted (for index mirrors) and
    the measured load calls (for the adaptive load policy); ``settled``: page-set keys whose
    store this worker finished (stored, failed or dropped), once per key and worker."""

    stored: dict[str, list[str]] = field(default_factory=dict)
    evicted: dict[str, list[str]] = field(default_factory=dict)
    load_samples: dict[str, list[LoadSample]] = field(default_factory=dict)
    settled: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, OffloadWorkerMetadata)
        self.settled.extend(other.settled)
        for mine, theirs in (
            (self.stored, other.stored),
            (self.evicted, other.evicted),
            (self.load_samples, other.load_samples),
        ):
            for backend, items in theirs.items():
                mine.setdefault(backend, []).extend(items)  # type: ignore[arg-type]  # per pair alike
        return self

    def is_empty(self) -> bool:
        return not self.settled and not any(self.stored.values()) and not any(
            self.evicted.values()
        ) and not any(self.load_samples.values())
