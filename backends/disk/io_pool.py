"""The disk layouts' page I/O threads: batches mapped over a small pool, loads cut into parts.

Both layouts read (and the ``files`` layout writes) pages through one :class:`IoPool` of
``io_threads`` threads, started on first use. :meth:`IoPool.map` runs one task per item for
batches; :meth:`IoPool.run_parts` runs the first of several parts on the calling thread and the
others in the pool at the same time, every one finished before it returns (the caller may then
close the descriptors and hand back the buffers the parts used). A call racing
:meth:`IoPool.close` raises what the backend's ``check_open`` raises
(:class:`~hybrid_offload.backends.base.BackendClosedError`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

__all__ = ["IoPool"]

_T = TypeVar("_T")
_R = TypeVar("_R")


class IoPool:
    """``threads`` I/O threads named ``name``, started on first use (see the module docstring)."""

    def __init__(
        self, threads: int, name: str, check_open: Callable[[], None], *, min_batch: int = 0
    ) -> None:
        self.threads = threads
        self.min_batch = min_batch
        self._name = name
        self._check_open = check_open
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            self._check_open()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self._name)
            return self._pool

    def map(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """``fn`` of each item, in the pool (on this thread for ``min_batch`` items or fewer,
        or with one thread); results in input order."""
        if len(items) <= self.min_batch or self.threads == 1:
            return [fn(item) for item in items]
        pool = self._executor()
        try:
            return list(pool.map(fn, items))
        except RuntimeError:  # the pool was shut down by a concurrent close()
            self._check_open()
            raise

    def run_parts(self, fn: Callable[[_T], _R], parts: Sequence[_T]) -> list[_R]:
        """``fn`` of each part: the first on this thread, the others in the pool at the same
        time (every one finished before this returns); results in input order."""
        if len(parts) <= 1 or self.threads == 1:
            return [fn(part) for part in parts]
        futures: list[Future[_R]] = []
        try:
            pool = self._executor()
            try:
                for part in parts[1:]:
                    futures.append(pool.submit(fn, part))
            except RuntimeError:  # the pool was shut down by a concurrent close()
                self._check_open()
                raise
            first = fn(parts[0])
        finally:
            wait(futures)
        return [first] + [future.result() for future in futures]

    def map_parts(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """``fn`` of each item, the items cut into ``threads`` consecutive parts run by
        :meth:`run_parts`; results in input order. One task per part, not per item: a pool
        round trip per page costs more than reading a cached page. As many parts as threads,
        not fewer on few CPUs (as the segment layout cuts its reads, :func:`.direct.read_parts`):
        each page is a request of its own, and cold pages came faster with 4 in flight than
        with 2 on 2 cores."""
        parts = min(self.threads, len(items))
        if parts <= 1:
            return [fn(item) for item in items]
        cuts = [len(items) * k // parts for k in range(parts + 1)]
        groups = [items[cuts[k] : cuts[k + 1]] for k in range(parts)]
        done = self.run_parts(lambda group: [fn(item) for item in group], groups)
        return [out for group in done for out in group]

    def close(self) -> None:
        """Stop the threads, waiting for the tasks in flight; a later call starts none."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
