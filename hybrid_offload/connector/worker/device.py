"""The device side of the data path: where vLLM's KV cache lives, and how bytes cross to it.

Worker side; torch alone (no vLLM), so the data path runs on a GPU machine without vLLM. One
design for both devices:

* **Loads**: a load's verified pages sit in host memory the device copies from at the link's
  speed (pinned staging rows, the cpu tier's arena once :meth:`pin` locked it). The load
  thread enqueues, on the *load stream* and after what the compute stream held when the load
  started (:meth:`mark`, taken on the model-runner thread), one copy per run of pages side by
  side to a device block, the payload checks and the scatters into vLLM's blocks, then waits
  for them: the model-runner thread only reports the load.
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
from collections.abc import Callable, Iterator

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

    def __init__(self, device: torch.device | str = "cpu", device_path: bool | None = None) -> None:
        """``device_path``: take the GPU's paths (loads checked and written on the load thread,
        stores checksummed and copied on the store thread) on any device; by default on CUDA
        only. On CPU they run without streams: the tests prove the GPU's code there."""
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.device_path = self.is_cuda if device_path is None else device_path
        self._slots: list[torch.Tensor] = []
        if self.is_cuda:
            self._load_stream = torch.cuda.Stream(self.device)
            self._store_stream = torch.cuda.Stream(self.device)
            self._copy_stream = torch.cuda.Stream(self.device)

    def host_pool(self, max_bytes: int) -> MemoryPool:
        """A pool of host blocks for staging and store rows: pinned where the device copies
        from and to pinned memory asynchronously."""
        if self.is_cuda:
            return MemoryPool(max_bytes, lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        return MemoryPool(max_bytes)

    # ---- loads ------------------------------------------------------------------------
    def pin(self, memory: memoryview) -> Callable[[], None] | None:
        """Page-lock ``memory`` (a tier's arena) for copies to and from the device at the link's
        speed; returns what unlocks it (call it before the memory goes), or None where the
        device has no pinned memory or locking failed (copies then go through the driver's
        staging, slower but correct)."""
        if not self.is_cuda or memory.nbytes == 0:
            return None
        tensor = torch.frombuffer(memory, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)) != 0:
            return None
        ptr = tensor.data_ptr()
        return lambda: cudart.cudaHostUnregister(ptr)

    def mark(self) -> torch.cuda.Event | None:
        """An event after everything the compute stream holds now (model-runner thread), for
        :meth:`loading` to start after; None on CPU."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def loading(self, after: torch.cuda.Event | None = None) -> Iterator[None]:
        """Work enqueued inside runs on the load stream, after ``after`` (a :meth:`mark`), or
        else after everything the compute stream holds so far (blocks given to a load may have
        been another request's a step ago). Any thread may enqueue."""
        if not self.is_cuda:
            yield
            return
        if after is not None:
            self._load_stream.wait_event(after)
        else:
            self._load_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._load_stream):
            yield

    def load_slots(self, nbytes: int) -> list[torch.Tensor]:
        """The two device blocks a load's pages pass through, at least ``nbytes`` each: made on
        first use and kept (grown only for a larger page), so loads use a fixed amount of
        device memory whatever their length. Load thread only."""
        if not self._slots or self._slots[0].numel() < nbytes:
            self._slots = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._slots

    @contextlib.contextmanager
    def copying(self, after: torch.cuda.Event | None) -> Iterator[None]:
        """Copies to the device enqueued inside run on the copy stream (beside the load stream's
        kernels), after ``after``; no-op on CPU."""
        if not self.is_cuda:
            yield
            return
        if after is not None:
            self._copy_stream.wait_event(after)
        with torch.cuda.stream(self._copy_stream):
            yield

    def event(self, timing: bool = False) -> torch.cuda.Event | None:
        """An event recorded on the current stream now (None on CPU)."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def after(self, event: torch.cuda.Event | None) -> None:
        """The current stream's later work waits for ``event``."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def drain_loads(self) -> None:
        """Block until everything enqueued on the load stream is complete (a load that failed
        half-way must not be reported while its writes may still run)."""
        if self.is_cuda:
            self._copy_stream.synchronize()
            self._load_stream.synchronize()

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

    @property
    def store_stream(self) -> torch.cuda.Stream:
        return self._store_stream

    @contextlib.contextmanager
    def storing(self, after_compute: bool = True) -> Iterator[None]:
        """Work enqueued inside runs on the store stream: after everything the compute stream
        holds so far (``after_compute``: the model-runner thread, right after a gather), or
        only after what the store stream holds (the store thread, later). No-op on CPU."""
        if not self.is_cuda:
            yield
            return
        if after_compute:
            self._store_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._store_stream):
            yield

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
