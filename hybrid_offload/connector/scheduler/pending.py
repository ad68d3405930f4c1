"""Page sets the scheduler asked to store that the workers have not finished yet.

A request that shares a prefix with one that just ran (the next turn of a chat, the same
prompt asked again) is usually looked up while the pages it needs are still being written: the
worker copies them out after the forward and writes them on its store thread. Looking up then
would miss them and recompute what the cache is about to hold, so the scheduler side defers
such a lookup (vLLM skips the request for this step and asks again at the next) until every
worker has reported the pages stored or failed, for at most ``wait_s`` per request.

Scheduler thread only; the clock is injected for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hybrid_offload.connector.config import DEFAULT_PENDING_STORE_WAIT_S


@dataclass
class _Entry:
    reports_left: int
    deadline: float


class PendingStores:
    """Page-set keys in flight, each settled once ``reports`` workers reported it (one per TP rank
    that writes a shard of it), or forgotten after ``wait_s``."""

    def __init__(self, wait_s: float = DEFAULT_PENDING_STORE_WAIT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.wait_s = wait_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._waiting_since: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: str, reports: int) -> None:
        """``key`` is being stored by ``reports`` workers (a repeated store adds reports)."""
        entry = self._entries.get(key)
        deadline = self._clock() + self.wait_s
        if entry is None:
            self._entries[key] = _Entry(reports, deadline)
        else:
            entry.reports_left += reports
            entry.deadline = deadline

    def settle(self, keys: Iterable[str]) -> None:
        """One worker finished these keys (stored, failed or dropped)."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                entry.reports_left -= 1
                if entry.reports_left <= 0:
                    del self._entries[key]

    def in_flight(self) -> bool:
        """Whether some store is still unsettled (and not expired)."""
        if self._entries:
            self._expire(self._clock())
        return bool(self._entries)

    def should_wait(self, req_id: str, keys: Iterable[str]) -> bool:
        """Whether ``req_id``'s lookup should wait: some of ``keys`` are in flight and the request
        has not waited ``wait_s`` yet. Call :meth:`done_waiting` once it is looked up for good."""
        if not self._entries:
            return False
        now = self._clock()
        self._expire(now)
        if not any(key in self._entries for key in keys):
            return False
        since = self._waiting_since.setdefault(req_id, now)
        return now - since < self.wait_s

    def done_waiting(self, req_id: str) -> None:
        self._waiting_since.pop(req_id, None)

    def _expire(self, now: float) -> None:
        expired = [k for k, e in self._entries.items() if e.deadline <= now]
        for key in expired:
            del self._entries[key]
