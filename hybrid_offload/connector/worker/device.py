"""The device side of the data path: where vLLM's KV cache lives, and how bytes cross to it.

Worker side; torch alone (no vLLM), so the data path runs on a GPU machine without vLLM. One
design for both devices:

* **Loads**: a load's verified pages sit in one host block (pinned on CUDA). :meth:`load_copy`
  enqueues one copy of the whole block to the device on the *load stream*; the scatters into
  vLLM's blocks are enqueued after it, on the same stream, and a :class:`Ready` (a CUDA event)
  tells the step when they are done: nothing on the model-runner thread waits for the copy.
* **Stores**: the step's pages are gathered out of vLLM's blocks into one device block on the
  compute stream right after the forward (a few device-to-device kernels), then one copy to a
  pinned host block is enqueued on the *store stream*; the store thread waits on its
  :class:`Ready` before sealing the pages. The next forward may overwrite the blocks as soon as
  the gather kernels ran; it never waits for the copy to the host.
* On CPU the same calls run with no streams, no pinning and no copies: the host block *is*
  the device block and every :class:`Ready` is done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hybrid_offload.connector.worker.memory_pool import MemoryPool

__all__ = ["DeviceTransfers", "Ready"]


class Ready:
    """Whether enqueued device work is complete: a CUDA event, or nothing (already done)."""

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self._event = event

    def done(self) -> bool:
        """Whether the work is complete (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Block the calling thread until the work is complete."""
        if self._event is not None:
            self._event.synchronize()


class DeviceTransfers:
    """Pinned host pools, the load and store streams of one worker's KV cache device.

    ``device`` is the device of the KV cache tensors vLLM registered. Streams and pinned memory
    exist on CUDA only; on other devices every method degrades to plain host work.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda:
            self._load_stream = torch.cuda.Stream(self.device)
            self._store_stream = torch.cuda.Stream(self.device)

    def host_pool(self, max_bytes: int) -> MemoryPool:
        """A pool of host blocks for staging and store rows: pinned where the device copies
        from and to pinned memory asynchronously."""
        if self.is_cuda:
            return MemoryPool(max_bytes, lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        return MemoryPool(max_bytes)

    # ---- loads ------------------------------------------------------------------------
    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Work enqueued inside runs on the load stream, after everything the compute stream
        holds so far (blocks given to a load may have been another request's a step ago)."""
        if not self.is_cuda:
            yield
            return
        self._load_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._load_stream):
            yield

    def load_copy(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (a pinned uint8 block) on the device: one asynchronous copy, inside
        :meth:`loading`. On CPU, ``host`` itself."""
        if not self.is_cuda:
            return host
        return host.to(self.device, non_blocking=True)

    def loaded(self) -> Ready:
        """Inside :meth:`loading`, after the scatters: complete once they are."""
        return self._record(self._load_stream) if self.is_cuda else Ready()

    # ---- stores -----------------------------------------------------------------------
    def gather_block(self, host: torch.Tensor, nbytes: int) -> torch.Tensor:
        """Where a step's ``nbytes`` of pages are gathered before they go to ``host`` (a uint8
        block at least that large): a device block, or ``host`` itself on CPU."""
        if not self.is_cuda:
            return host
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def store_copy(self, gathered: torch.Tensor, host: torch.Tensor) -> None:
        """Enqueue the copy of ``gathered`` (filled on the compute stream) into ``host`` on the
        store stream; no-op on CPU (they are one block). :meth:`stored` marks its completion."""
        if not self.is_cuda:
            return
        self._store_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._store_stream):
            host[: gathered.numel()].copy_(gathered, non_blocking=True)
        gathered.record_stream(self._store_stream)  # the allocator keeps it until the copy ran

    def stored(self) -> Ready:
        """Complete once every copy :meth:`store_copy` enqueued so far is (the store stream
        runs them in order, so copies held for later commits are covered too)."""
        return self._record(self._store_stream) if self.is_cuda else Ready()

    @staticmethod
    def _record(stream: torch.cuda.Stream) -> Ready:
        event = torch.cuda.Event(blocking=True)  # a waiting thread sleeps instead of spinning
        event.record(stream)
        return Ready(event)
