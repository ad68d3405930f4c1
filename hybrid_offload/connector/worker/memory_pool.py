"""Memory reused across loads and stores instead of allocated fresh each time.

Worker side. A fresh allocation of many KiB is page-faulted on its first touch: for a load's
staging block that happens inside the backend read, for a step's store rows inside the copy out
of the KV cache on the model-runner thread. A :class:`MemoryPool` keeps the blocks given back
for the next taker, bounded in bytes; the oldest go first. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["LOAD_POOL_BYTES", "STORE_POOL_BYTES", "MemoryPool"]

#: free staging memory a worker keeps for its next loads
LOAD_POOL_BYTES = 512 << 20
#: free store rows a worker keeps for its next steps' stores
STORE_POOL_BYTES = 256 << 20


class MemoryPool:
    """Free uint8 blocks (not zeroed), up to ``max_bytes`` in all.

    ``take(n)`` returns the smallest free block of at least ``n`` bytes, else a new one;
    ``give(block)`` hands back a block nothing reads or writes any more (one larger than
    ``max_bytes`` is not kept). ``allocate(n)`` makes a new block (pinned memory, say).
    """

    def __init__(self, max_bytes: int, allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        self.max_bytes = max_bytes
        self._allocate = allocate or (lambda n: torch.empty(n, dtype=torch.uint8))
        self._by_size: dict[int, list[torch.Tensor]] = {}
        self._order: dict[int, torch.Tensor] = {}  # id(block) -> block, oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            size = min((s for s, free in self._by_size.items() if s >= nbytes and free), default=None)
            if size is not None:
                block = self._by_size[size].pop()
                del self._order[id(block)]
                self._bytes -= size
                return block
        return self._allocate(nbytes)

    def give(self, block: torch.Tensor) -> None:
        size = block.numel()
        with self._lock:
            self._by_size.setdefault(size, []).append(block)
            self._order[id(block)] = block
            self._bytes += size
            while self._bytes > self.max_bytes:
                oldest = self._order.pop(next(iter(self._order)))
                free = self._by_size[oldest.numel()]
                del free[next(i for i, b in enumerate(free) if b is oldest)]
                self._bytes -= oldest.numel()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._bytes
