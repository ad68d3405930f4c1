"""LMCache 0.5.6's ``StorageManager`` as the peer baseline of `hybrid-offload bench backends`.

One tier per manager: ``cpu`` (LocalCPUBackend only), ``disk`` (LocalDiskBackend; its
LocalCPUBackend is the allocator, as in LMCache) and ``redis`` (RemoteBackend, ``redis://``,
``naive`` serde). A store call is ``batched_allocate`` + one copy of each page into its memory
object + ``batched_put``, then waiting until ``batched_contains`` sees every key in the tier
(LMCache writes disk and remote asynchronously). A load call is ``batched_get`` from the tier plus
one copy of each chunk into the caller's buffer (what our ``get_into`` does). Chunks are uint8
``KV_2LTD`` objects of shape ``[2, 1, 1, page // 2]`` (LMCache's CPU allocator refuses
``UNDEFINED``). LMCache is imported through ``hybrid_offload.backends.lmcache`` (its CPU-torch
import path); when that fails every tier reports the reason instead of numbers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hybrid_offload.tools.bench.ceilings import slots, time_calls

logger = logging.getLogger(__name__)

TIER_LOCATION = {"cpu": "LocalCPUBackend", "disk": "LocalDiskBackend", "redis": "RemoteBackend"}
_WAIT_S = 30.0


def import_error() -> str | None:
    """None when LMCache imports here, else why not."""
    try:
        import hybrid_offload.backends.lmcache  # noqa: F401  (sets up LMCache's CPU import path)
    except Exception as exc:  # any import failure is a reason to report, not to crash the bench
        return f"LMCache import failed: {type(exc).__name__}: {exc}"
    return None


@contextlib.contextmanager
def _environ_unchanged(name: str) -> Iterator[None]:
    """Undo LMCache's write of ``os.environ[name]`` when the block ends.

    LMCache's PrometheusLogger sets ``PROMETHEUS_MULTIPROC_DIR=/tmp/lmcache_prometheus`` in
    this process's environment; every process started afterwards (vLLM servers, peers) would
    inherit it and share one metrics directory with every other such process, across runs.
    """
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def make_manager(tier: str, page: int, cpu_gb: float, disk_dir: str | None, redis_url: str | None) -> Any:
    """A StorageManager with LocalCPU (+ LocalDisk at ``disk_dir`` or Remote at ``redis_url``)."""
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    kw: dict[str, Any] = {"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": cpu_gb}
    if tier == "disk":
        if disk_dir is None:
            raise ValueError("LMCache's disk tier needs a directory")
        kw |= {"local_disk": disk_dir.rstrip("/") + "/", "max_local_disk_size": 4.0}
    elif tier == "redis":
        kw |= {"remote_url": redis_url, "remote_serde": "naive"}
    config = LMCacheEngineConfig.from_defaults(**kw)
    metadata = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.uint8, kv_shape=(1, 2, 256, 1, page // 2),
                               role="worker")  # fmt: skip
    with _environ_unchanged("PROMETHEUS_MULTIPROC_DIR"):
        return StorageManager(config, metadata, EventManager())


def make_keys(start: int, n: int) -> list[Any]:
    """LMCache cache keys ``start .. start + n - 1``."""
    import torch
    from lmcache.utils import CacheEngineKey

    return [CacheEngineKey("bench", 1, 0, i, torch.uint8) for i in range(start, start + n)]


class Tier:
    """One LMCache tier measured the way our backends are (see the module docstring)."""

    def __init__(self, tier: str, manager: Any) -> None:
        self.tier, self.sm = tier, manager
        self.location = TIER_LOCATION[tier]

    def wait_stored(self, keys: Sequence[Any]) -> None:
        """Block until every key is in this tier (LMCache's disk and remote puts are async)."""
        deadline = time.monotonic() + _WAIT_S
        while self.sm.batched_contains(list(keys), search_range=[self.location])[0] < len(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"LMCache {self.tier}: pages not stored after {_WAIT_S} s")
            time.sleep(0.0005)

    def store(self, keys: Sequence[Any], data: bytes) -> None:
        """Allocate, copy ``data`` into each chunk, batched_put, wait until stored."""
        import torch
        from lmcache.v1.memory_management import MemoryFormat

        objs = self.sm.batched_allocate(torch.Size([2, 1, 1, len(data) // 2]), torch.uint8, len(keys),
                                        MemoryFormat.KV_2LTD)  # fmt: skip
        if objs is None:
            raise RuntimeError(f"LMCache {self.tier}: allocation failed")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for obj in objs:
            obj.tensor.view(-1).copy_(src)
        self.sm.batched_put(list(keys), objs)
        self.wait_stored(keys)

    def load(self, keys: Sequence[Any], bufs: Sequence[memoryview]) -> None:
        """batched_get from the tier and copy each chunk into its buffer."""
        got = self.sm.batched_get(list(keys), location=self.location)
        if any(obj is None for obj in got):
            raise RuntimeError(f"LMCache {self.tier}: a stored chunk missed")
        import torch

        for obj, buf in zip(got, bufs, strict=True):
            torch.frombuffer(buf, dtype=torch.uint8).copy_(obj.tensor.view(-1))
            obj.ref_count_down()

    def remove(self, keys: Sequence[Any]) -> None:
        """Free the keys locally (LMCache's Redis connector cannot remove: the caller flushes)."""
        with contextlib.suppress(Exception):
            self.sm.batched_remove(list(keys), locations=["LocalCPUBackend", "LocalDiskBackend"])


def measure(
    tier: Tier, page: int, batch: int, calls: int, pool: int, first_key: int
) -> dict[str, dict[str, Any]]:
    """Store then load ``calls`` batches cycling through ``pool`` keys; the pool is removed after."""
    import os

    keys = make_keys(first_key, pool)
    data = os.urandom(page)
    bufs = [memoryview(bytearray(page)) for _ in range(batch)]
    plan = slots(pool, batch, calls)

    def call(fn: Callable[..., None], r: range, *extra: Any) -> Callable[[], None]:
        return lambda: fn([keys[i] for i in r], *extra)

    try:
        out = {"store": time_calls([call(tier.store, r, data) for r in plan], page * batch)}
        out["load"] = time_calls([call(tier.load, r, bufs) for r in plan], page * batch)
        return out
    finally:
        tier.remove(keys)


def probe_count(spec: dict[str, Any]) -> int:
    """Fresh-process side of the cross-restart check: how many of the keys a new manager finds."""
    import_error()
    sm = make_manager(spec["tier"], spec["page"], 0.25, spec.get("disk_dir"), spec.get("redis_url"))
    keys = make_keys(spec["first_key"], spec["n"])
    return int(sm.batched_contains(keys, search_range=[TIER_LOCATION[spec["tier"]]])[0])
