"""Messages between the scheduler side and the worker side of the connector.

Scheduler -> worker: :class:`OffloadMetadata` (bound to every step). Worker -> scheduler:
:class:`OffloadWorkerMetadata` (returned with every step's output). Both are plain data that
vLLM carries between processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


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


@dataclass(frozen=True)
class LoadSegment:
    """Pages to read from one backend."""

    backend: str
    pages: tuple[PageJob, ...]


@dataclass(frozen=True)
class LoadJob:
    """Load the pages of request ``req_id``: each segment from its backend; a page missing or
    bad there is tried in the ``fallbacks`` backends, in order, before the load fails."""

    req_id: str
    segments: tuple[LoadSegment, ...]
    fallbacks: tuple[str, ...] = ()

    @property
    def pages(self) -> tuple[PageJob, ...]:
        return tuple(p for s in self.segments for p in s.pages)


@dataclass(frozen=True)
class StoreJob:
    """Copy ``page`` out of the KV cache now and put it into ``backends`` (in background)."""

    page: PageJob
    backends: tuple[str, ...]


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    """This step's work for the worker side."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


#: one measured load call: (bytes read, seconds, succeeded)
LoadSample = tuple[int, float, bool]


@dataclass
class OffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Per backend since the last report: the keys stored and evicted (for index mirrors) and
    the measured load calls (for the adaptive load policy)."""

    stored: dict[str, list[str]] = field(default_factory=dict)
    evicted: dict[str, list[str]] = field(default_factory=dict)
    load_samples: dict[str, list[LoadSample]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, OffloadWorkerMetadata)
        for mine, theirs in (
            (self.stored, other.stored),
            (self.evicted, other.evicted),
            (self.load_samples, other.load_samples),
        ):
            for backend, items in theirs.items():
                mine.setdefault(backend, []).extend(items)  # type: ignore[arg-type]
        return self

    def is_empty(self) -> bool:
        return not any(self.stored.values()) and not any(self.evicted.values()) and not any(
            self.load_samples.values()
        )
