"""What the scheduler process sees of one tier: :class:`BackendView`.

Scheduler side. A tier whose index other processes see (disk, Redis, a peer) is opened here and
asked; a tier only this engine's workers hold (the cpu pool) is answered from a mirror of the
workers' reports (``stored`` / ``evicted`` keys in :class:`~.metadata.OffloadWorkerMetadata`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hybrid_offload.backends.base import Backend
from hybrid_offload.backends.health import BackendHealth
from hybrid_offload.backends.registry import backend_class
from hybrid_offload.backends.wrappers import BackendSkippedError
from hybrid_offload.connector.config import Tier
from hybrid_offload.connector.tiers import SchedulerRecorder, open_tier
from hybrid_offload.core.metrics import Locked

__all__ = ["BackendView"]


class BackendView:
    """Answers ``contains`` for one tier from the scheduler process.

    A shared-index backend is opened through :func:`~.tiers.open_tier`: while it backs off
    after a failure its lookups are all misses. A backend only this engine's workers see (the
    cpu pool) is answered from a mirror of their reports.
    """

    def __init__(
        self, tier: Tier, stats: Locked, index: int = 0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.tier = tier
        self.policy = tier.policy
        # the class that will serve these options tells the flags (a wrapping type's depend on them)
        cls = backend_class(tier.backend.type).implementation(dict(tier.backend.options))
        self.shared = cls.shared_index
        self.hit_source = cls.hit_source
        self.touch_refreshes = cls.touch_refreshes
        opened = open_tier(tier, index, SchedulerRecorder(stats), clock) if self.shared else None
        #: the opened tier (shared-index backends only; others are seen through the mirror)
        self.opened = opened
        self._backend: Backend | None = None if opened is None else opened.backend
        self.health: BackendHealth | None = None if opened is None else opened.health
        self._mirror: set[str] = set()

    @property
    def name(self) -> str:
        return self.tier.name

    @property
    def is_down(self) -> bool:
        """Whether this process backs off from the backend now (never for a mirror)."""
        return self.health is not None and self.health.is_down

    def contains(self, keys: list[str]) -> list[bool]:
        """Presence per key; raises BackendError when the backend fails (it then backs off)."""
        if self._backend is None:
            return [k in self._mirror for k in keys]
        try:
            return self._backend.contains_batch(keys)
        except BackendSkippedError:
            return [False] * len(keys)

    def apply_report(self, stored: list[str], evicted: list[str]) -> None:
        if self._backend is None:
            # Stored first, then evicted: a key put and evicted since the last report is gone.
            # (A key evicted and put again is forgotten too: that costs a hit, never a bad load.)
            self._mirror.update(stored)
            self._mirror.difference_update(evicted)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
