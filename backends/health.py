"""Backoff for unavailable backends: a failed backend is skipped for a while, then probed.

A backend that raises :class:`~hybrid_offload.backends.base.BackendError` (server down,
timeout, peer gone) is marked down for ``retry_after_s`` seconds; each further failure doubles
the wait up to ``retry_after_max_s``. While down, the connector does not call it: lookups see
misses, stores skip it, so requests run at recompute speed instead of waiting on timeouts. The
first call after the wait is the probe: success marks the backend up again (and resets the
wait), failure marks it down for the next, longer wait.

Threading: thread-safe (one lock per backend); the scheduler thread and the worker's I/O
threads each keep their own :class:`BackendHealth` per backend (different processes under
``vllm serve``), so each side probes on its own schedule.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class BackendHealth:
    """Up/down state of one backend with exponential backoff."""

    def __init__(
        self,
        name: str,
        retry_after_s: float,
        retry_after_max_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < retry_after_s <= retry_after_max_s:
            raise ValueError(
                f"backend {name!r}: need 0 < retry_after_s <= retry_after_max_s, "
                f"got {retry_after_s!r}, {retry_after_max_s!r}"
            )
        self.name = name
        self._initial = retry_after_s
        self._max = retry_after_max_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until: float | None = None
        self._wait = retry_after_s
        self.failures = 0
        self.skipped = 0
        self.recoveries = 0

    @property
    def is_down(self) -> bool:
        with self._lock:
            return self._down_until is not None

    def available(self) -> bool:
        """Whether a call may go to the backend now (up, or its wait is over: a probe)."""
        with self._lock:
            if self._down_until is None or self._clock() >= self._down_until:
                return True
            self.skipped += 1
            return False

    def record_failure(self, op: str, exc: object) -> None:
        """Mark down after a failed call; the wait doubles on each consecutive failure."""
        with self._lock:
            self.failures += 1
            first = self._down_until is None
            wait = self._initial if first else min(self._wait * 2, self._max)
            self._wait = wait
            self._down_until = self._clock() + wait
        if first:
            logger.warning(
                "backend %s unavailable on %s (%s); skipping it for %.1fs (requests recompute)",
                self.name,
                op,
                exc,
                wait,
            )
        else:
            logger.info("backend %s still unavailable (%s); next probe in %.1fs", self.name, exc, wait)

    def record_success(self) -> None:
        """Mark up after a successful call (a no-op when already up)."""
        with self._lock:
            if self._down_until is None:
                return
            self._down_until = None
            self._wait = self._initial
            self.recoveries += 1
        logger.warning("backend %s is available again", self.name)
