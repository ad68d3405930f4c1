"""Memory reused across loads and stores instead of allocated fresh each time.

Worker side. A fresh allocation of many KiB is page-faulted on its first touch: for a load's
staging block that happens inside the backend read, for a store's page buffers inside the
gather on the model-runner thread (the step's critical path). A :class:`MemoryPool` keeps
blocks given back for the next taker, bounded in bytes; the oldest go first. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

__all__ = ["MemoryPool", "page_buffers", "staging_blocks"]

B = TypeVar("B")


class MemoryPool(Generic[B]):
    """Free blocks of ``size_of`` bytes each, made by ``make(nbytes)``, up to ``max_bytes``.

    ``take(n)`` returns a free block of exactly ``n`` bytes, else (unless ``exact``) the
    smallest free one larger, else a new one. ``give(block)`` hands a block nothing reads or
    writes any more back; a block larger than ``max_bytes`` is not kept.
    """

    def __init__(self, make: Callable[[int], B], size_of: Callable[[B], int], max_bytes: int, *,
                 exact: bool = False) -> None:  # fmt: skip
        self.max_bytes = max_bytes
        self._make, self._size_of, self._exact = make, size_of, exact
        self._by_size: dict[int, list[B]] = {}
        self._order: dict[int, tuple[int, B]] = {}  # id(block) -> (size, block), oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> B:
        with self._lock:
            size = nbytes if self._by_size.get(nbytes) else None
            if size is None and not self._exact:
                size = min((s for s, free in self._by_size.items() if s > nbytes and free), default=None)
            if size is not None:
                block = self._by_size[size].pop()
                del self._order[id(block)]
                self._bytes -= size
                return block
        return self._make(nbytes)

    def give(self, block: B) -> None:
        size = self._size_of(block)
        with self._lock:
            self._by_size.setdefault(size, []).append(block)
            self._order[id(block)] = (size, block)
            self._bytes += size
            while self._bytes > self.max_bytes:
                old_size, oldest = self._order.pop(next(iter(self._order)))
                free = self._by_size[old_size]
                del free[next(i for i, b in enumerate(free) if b is oldest)]
                self._bytes -= old_size

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._bytes


#: free staging memory a worker keeps for its next loads
STAGING_BYTES = 512 << 20
#: free page buffers a worker keeps for its next stores
PAGE_BUFFER_BYTES = 256 << 20


def staging_blocks(max_bytes: int = STAGING_BYTES) -> MemoryPool[torch.Tensor]:
    """Loads' staging blocks: uint8 tensors, not zeroed; a larger free block serves."""
    return MemoryPool(lambda n: torch.empty(n, dtype=torch.uint8), lambda t: t.numel(), max_bytes)


def page_buffers(max_bytes: int = PAGE_BUFFER_BYTES) -> MemoryPool[bytearray]:
    """Stores' page buffers: bytearrays of exactly a page's length."""
    return MemoryPool(bytearray, len, max_bytes, exact=True)
