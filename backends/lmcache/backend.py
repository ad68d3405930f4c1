"""LMCache's storage stack as a page tier: any remote store LMCache has a connector for.

Role: store our canonical pages (opaque bytes under our keys) through LMCache 0.5.6's
``RemoteConnector`` layer (``lmcache.v1.storage_backend.connector.CreateConnector``), so its
Redis connector (``redis://``, ``rediss://``, ``unix://``), its file-system connector
(``fs://host:0/path``), its ``lm://`` server and the other stores it supports become a tier. This
is the lowest LMCache layer that moves bytes under a key without a GPU: the backend hands it
CPU ``TensorMemoryObj`` s (1-D ``uint8``, ``MemoryFormat.UNDEFINED``) from a small heap allocator
(a ``LocalCPUBackend`` stand-in, the pattern of LMCache's own ``SafeLocalCPUBackend``) and runs
its coroutines on a private event-loop thread. ``StorageManager``/``LMCacheEngine`` are not used:
they need a GPU connector and a model's KV layout. LMCache is installed by
``scripts/install_lmcache.sh`` (``--no-deps``, no CUDA packages); this module imports it at import
time and raises ``ImportError`` naming that script when it is missing.

Options: see :mod:`hybrid_offload.backends.lmcache.options` (``remote_url``, ``namespace``,
``op_timeout_s``, ``close_timeout_s``, ``ttl_s``, ``password_file`` / ``password_env``). LMCache
logs the URLs it is handed, so a Redis remote's password goes to redis-py only, never into a
URL (:mod:`hybrid_offload.backends.lmcache.connect`).

Contract beyond :mod:`hybrid_offload.backends.base`:

* **Keys.** Page key ``<ns>-<digest>`` becomes ``CacheEngineKey(model_name=f"{namespace}-{ns}",
  world_size=1, worker_id=0, chunk_hash=int("1" + digest, 16), dtype=uint8)``, whose string is
  ``<namespace>-<ns>@1@0@1<digest>@uint8`` (the leading ``1`` keeps the digest's leading zeros:
  the mapping is one-to-one).
* **One value per page, torn writes are misses.** LMCache writes each value under its own key
  (Redis: ``<key>kv_bytes``, plus ``<key>metadata`` holding only LMCache's 28-byte shape record;
  fs: one file). The backend stores one envelope per page in that value: a 24-byte header
  (magic ``HOLM``, version, kind, payload length, xxh3-64 of key + payload) then the page bytes.
  A get returns the page only if the value's length, magic, kind and checksum (which binds the
  value to its key) all match; anything else (LMCache's two Redis keys from different writes, a
  value copied under another key, garbage) is a miss, counted in ``stats.errors``.
* **Index, capacity and LRU are client side.** LMCache's connectors enforce no capacity and keep
  no LRU, and its Redis connector cannot delete (``RemoteConnector.remove_sync`` raises
  ``NotImplementedError``) or list keys. So each instance keeps an index (key -> size, LRU order
  by last put/get) and enforces ``capacity_bytes`` over it, as the ``cpu`` pool does
  (:mod:`.local_index`). A
  deleted or evicted page is removed through ``remove_sync`` where the connector has it (fs),
  otherwise overwritten with a 24-byte tombstone envelope (Redis): its page bytes are freed, but
  the two small Redis keys of a tombstone stay until they expire (``ttl_s``) or the key is put
  again (about 200 bytes per deleted key, not counted in ``used_bytes``).
* **Expiry across restarts.** A new instance starts with an empty index and never reads what an
  earlier one stored, so values expire ``ttl_s`` (default one day) after their last put or get
  (Redis: PEXPIRE; fs: swept at start-up by mtime), see
  :mod:`hybrid_offload.backends.lmcache.expiry`; other remotes grow (a warning at start-up).
* **Visibility.** ``shared_index = False``: the index lives in this process (another process
  cannot tell a tombstone from a page without reading it, nor learn sizes or recency), so the
  connector mirrors it from ``take_evicted`` (keys evicted, deleted, lost by the remote or whose
  put failed, oldest first). Pages do not survive a restart from this backend's point of view
  (the Redis connector cannot list keys): a new instance starts empty. ``contains_batch``
  answers from the index without I/O; ``get_batch`` does I/O only for indexed keys. A page the
  remote lost (Redis eviction, flush) is dropped from the index on the get that finds it gone
  and reported by ``take_evicted``.
* **Threading / blocking.** One lock per instance is held for a whole batch call, I/O included,
  so this process never has two writes of one key in flight (LMCache's Redis connector writes its
  two keys non-atomically). Within a call, all keys go to LMCache at once (one ``put``/``get``
  coroutine per page in one ``asyncio.gather``; not ``batched_put``, whose LMCache wrapper
  swallows errors) on the backend's event-loop thread.
* **Errors.** Anything LMCache or the remote raises (connection refused, timeout, server gone)
  counts in ``stats.errors`` and raises :class:`BackendUnavailableError`; the pages of that call
  are misses, and keys whose put failed leave the index (reported by ``take_evicted``).
  Construction never raises for an unreachable store: LMCache builds its connector on the
  loop thread and the constructor waits at most ``op_timeout_s`` for it (the Redis connector
  connects lazily; ``lm://`` connects in its constructor, with no timeout of its own). A
  connector not built yet, or whose build failed, is retried by later calls, which raise
  :class:`BackendUnavailableError` meanwhile. An URL no LMCache adapter parses raises
  :class:`BackendConfigError` at construction.
* **close()** is bounded: LMCache's ``RedisConnector.close()`` never returns (it calls the
  synchronous ``AsyncPQExecutor.shutdown()`` on its own event loop and waits on itself), so
  ``close()`` waits at most ``close_timeout_s``, logs a warning and abandons the (daemon) loop
  thread with the connector's sockets.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import struct
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

import xxhash

from ..base import (
    BackendConfig,
    BackendConfigError,
    BackendUnavailableError,
    Buffer,
)
from ..local_index import LocalIndexBackend
from ..redis.options import redact_url
from .expiry import EXPIRY_SCHEMES, make_expiry
from .options import (
    OPTION_DEFAULTS,
    check_remote_url,
    lmcache_password,
    validate_lmcache_options,
)

# LMCache's loggers attach opentelemetry-sdk's deprecated LoggingHandler (one warning each).
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*LoggingHandler", category=DeprecationWarning)
    try:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        from .connect import create_connector
    except ImportError as exc:  # chained, never swallowed: the registry re-raises it naming the type
        raise ImportError(
            f"the 'lmcache' backend needs LMCache 0.5.6 ({exc}). Install it with "
            "scripts/install_lmcache.sh (the [lmcache] extra: LMCache with --no-deps plus its pinned "
            "pure-Python dependencies; a plain `pip install lmcache` pulls CUDA torch)"
        ) from exc

__all__ = ["LMCacheBackend"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Envelope: magic, version, kind, 2 pad bytes, payload length, xxh3-64(key + b"\0" + payload).
_HEADER = struct.Struct("<4sBB2xQQ")
_MAGIC = b"HOLM"
_VERSION = 1
_KIND_PAGE = 1
_KIND_TOMBSTONE = 2
_RECONNECT_INTERVAL_S = 1.0


def _checksum(key: str, payload: Buffer) -> int:
    h = xxhash.xxh3_64(key.encode("ascii"))
    h.update(b"\0")
    h.update(payload)
    return h.intdigest()


class _HeapAllocator(LocalCPUBackend):
    """What LMCache's connectors need of a ``LocalCPUBackend``: ``config``, ``metadata`` and
    ``allocate()``. Each allocation is a fresh CPU tensor (no pool to exhaust or fragment);
    requests larger than ``limit`` bytes (garbage metadata) fail like a full pool (``None``)."""

    def __init__(self, config: Any, metadata: Any, limit: int) -> None:  # no super(): no pool
        self.config = config
        self.metadata = metadata
        self.limit = limit

    def allocate(
        self, shapes: Any, dtypes: Any, fmt: Any = None, eviction: bool = True, busy_loop: bool = True
    ) -> TensorMemoryObj | None:
        shapes = list(shapes) if isinstance(shapes, list) else [shapes]
        dtypes = list(dtypes) if isinstance(dtypes, list) else [dtypes]
        size = sum(torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
        if size <= 0 or size > self.limit:
            return None
        meta = MemoryObjMetadata(
            shape=torch.Size(shapes[0]),
            dtype=dtypes[0],
            address=0,
            phy_size=size,
            ref_count=1,
            fmt=fmt if fmt is not None else MemoryFormat.UNDEFINED,
            shapes=[torch.Size(s) for s in shapes],
            dtypes=dtypes,
        )
        return TensorMemoryObj(torch.empty(size, dtype=torch.uint8), meta, None)

    def get_full_chunk_size_bytes(self) -> int:
        return self.limit

    def __str__(self) -> str:
        return "hybrid_offload._HeapAllocator"


def _byte_view(obj: Any) -> memoryview:
    view = obj.byte_array
    view = view if isinstance(view, memoryview) else memoryview(view)
    return view.cast("B") if view.format != "B" else view


class LMCacheBackend(LocalIndexBackend[None]):
    """Pages through LMCache's remote connectors (see the module docstring)."""

    type_name: ClassVar[str] = "lmcache"
    option_defaults: ClassVar[dict[str, Any]] = dict(OPTION_DEFAULTS)

    @classmethod
    def validate_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        return validate_lmcache_options(super().validate_options(options))

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        options = self.validate_options(dict(config.options))
        self._op_timeout = options["op_timeout_s"]
        self._close_timeout = options["close_timeout_s"]
        self._namespace = options["namespace"]
        self._url = check_remote_url(options["remote_url"], self._op_timeout)
        # handed to redis-py only, never in a URL: LMCache logs the URLs it gets (connect.py)
        self._password = lmcache_password(options)
        self._expiry = make_expiry(self._url, options["ttl_s"], self._namespace, password=self._password)
        self._can_remove = True  # until the connector says NotImplementedError

        self._lm_config = LMCacheEngineConfig.from_defaults(
            chunk_size=256,
            local_cpu=False,
            max_local_cpu_size=0,
            remote_url=None,
            extra_config={"save_chunk_meta": True},
        )
        self._lm_metadata = LMCacheMetadata(
            model_name=self._namespace,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.uint8,
            kv_shape=(1, 1, 256, 1, 1),
        )
        self._allocator = _HeapAllocator(
            self._lm_config, self._lm_metadata, config.capacity_bytes + _HEADER.size
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"lmcache-io-{config.name}", daemon=True
        )
        self._thread.start()
        self._connector: Any = None
        self._building: concurrent.futures.Future[Any] | None = None
        self._next_connect = 0.0
        with self._lock:
            try:
                self._connect()
            except BackendUnavailableError as exc:
                logger.warning("lmcache backend %r: remote not reachable yet: %s", self.name, exc)
            except BaseException:
                self._loop.call_soon_threadsafe(self._loop.stop)
                raise
            self._sweep(options["ttl_s"])

    def _sweep(self, ttl_s: float | None) -> None:
        """At start-up: drop what earlier instances left past ``ttl_s`` (:mod:`.expiry`)."""
        scheme = urlsplit(self._url).scheme
        if ttl_s is None or scheme not in EXPIRY_SCHEMES:
            logger.warning(
                "lmcache backend %r: values in %s:// never expire, so the remote grows with every "
                "restart (this backend's index starts empty): clean it up outside, or use redis:// "
                "or fs:// with 'ttl_s'", self.name, scheme,
            )  # fmt: skip
            return
        try:
            removed = self._expiry.sweep()
        except OSError as exc:
            self.stats.errors += 1
            logger.warning("lmcache backend %r: sweeping expired values failed: %r", self.name, exc)
            return
        if removed:
            logger.info("lmcache backend %r: removed %d values older than %g s", self.name, removed, ttl_s)

    def _expire(self, keys: Sequence[str]) -> None:
        """Values of ``keys`` were just written or read: expire them ``ttl_s`` from now. A
        failure is counted and logged, never raised: the pages themselves are fine."""
        try:
            self._expiry.refresh([self._lm_key(key).to_string() for key in keys])
        except Exception as exc:  # redis-py or OS errors: a value may outlive ttl_s
            self.stats.errors += 1
            logger.warning("lmcache backend %r: expiry of %d values failed: %r", self.name, len(keys), exc)

    # -- helpers (call with the lock held) -------------------------------------------------

    def _connect(self) -> Any:
        """LMCache's connector, built once on the loop thread (``lm://`` connects in its
        constructor, without a timeout): waits at most ``op_timeout_s``; a build still running
        is picked up by a later call; a failed one is retried after a short pause."""
        if self._connector is not None:
            return self._connector
        if self._building is None:
            if time.monotonic() < self._next_connect:
                raise BackendUnavailableError(f"lmcache backend {self.name!r}: remote unreachable")
            building: concurrent.futures.Future[Any] = concurrent.futures.Future()

            def build() -> None:
                try:
                    args = (self._loop, self._allocator, self._lm_config, self._lm_metadata)
                    building.set_result(create_connector(self._url, self._password, *args))
                except BaseException as exc:
                    building.set_exception(exc)

            self._building = building
            self._loop.call_soon_threadsafe(build)
        try:
            self._connector = self._building.result(timeout=self._op_timeout)
        except TimeoutError as exc:
            self.stats.errors += 1
            raise BackendUnavailableError(
                f"lmcache backend {self.name!r}: LMCache connector not built in {self._op_timeout:g} s"
            ) from exc
        except ValueError as exc:
            self._building = None
            if "No adapter found" in str(exc):
                raise BackendConfigError(
                    f"backend {self.name!r}: option 'remote_url': LMCache has no connector for "
                    f"{redact_url(self._url)!r}"
                ) from exc
            self._connect_failed(exc)
        except Exception as exc:
            self._building = None
            self._connect_failed(exc)
        return self._connector

    def _connect_failed(self, exc: BaseException) -> None:
        self._next_connect = time.monotonic() + _RECONNECT_INTERVAL_S
        self.stats.errors += 1
        raise BackendUnavailableError(
            f"lmcache backend {self.name!r}: cannot create LMCache connector: {exc!r}"
        ) from exc

    def _run(self, coro_factory: Callable[[Any], Awaitable[_T]], what: str) -> _T:
        """Run ``coro_factory(connector)`` on the loop thread, bounded by ``op_timeout_s``."""
        connector = self._connect()

        async def wrapped() -> _T:
            return await coro_factory(connector)

        future = asyncio.run_coroutine_threadsafe(wrapped(), self._loop)
        try:
            return future.result(timeout=self._op_timeout)
        except TimeoutError as exc:
            future.cancel()
            self.stats.errors += 1
            raise BackendUnavailableError(
                f"lmcache backend {self.name!r}: {what} did not finish in {self._op_timeout:g} s"
            ) from exc
        except Exception as exc:
            self.stats.errors += 1
            raise BackendUnavailableError(f"lmcache backend {self.name!r}: {what} failed: {exc!r}") from exc

    def _lm_key(self, key: str) -> CacheEngineKey:
        namespace, _, digest = key.partition("-")
        return CacheEngineKey(
            model_name=f"{self._namespace}-{namespace}",
            world_size=1,
            worker_id=0,
            chunk_hash=int("1" + digest, 16),
            dtype=torch.uint8,
        )

    def _memory_obj(self, key: str, kind: int, payload: Buffer) -> TensorMemoryObj:
        payload = memoryview(payload).cast("B")
        size = _HEADER.size + payload.nbytes
        obj = self._allocator.allocate([torch.Size([size])], [torch.uint8], MemoryFormat.UNDEFINED)
        if obj is None:  # cannot happen: the caller refused pages over capacity
            raise AssertionError("lmcache backend: envelope larger than its allocator limit")
        view = _byte_view(obj)
        _HEADER.pack_into(view, 0, _MAGIC, _VERSION, kind, payload.nbytes, _checksum(key, payload))
        view[_HEADER.size :] = payload
        return obj

    def _unwrap(self, key: str, obj: Any) -> bytes | None:
        """The page in LMCache's value, or None if it is not a whole, valid page of ``key``."""
        if obj is None:
            return None
        try:
            view = _byte_view(obj)
        except ValueError:  # an empty value (NULL data pointer)
            self._corrupt(key, "empty value")
            return None
        if view.nbytes < _HEADER.size:
            self._corrupt(key, f"{view.nbytes}-byte value")
            return None
        magic, version, kind, length, checksum = _HEADER.unpack_from(view, 0)
        if magic != _MAGIC or version != _VERSION:
            self._corrupt(key, "bad magic/version")
            return None
        if kind == _KIND_TOMBSTONE:
            return None
        payload = view[_HEADER.size :]
        if kind != _KIND_PAGE or length != payload.nbytes or checksum != _checksum(key, payload):
            self._corrupt(key, "length/checksum mismatch")
            return None
        return bytes(payload)

    def _corrupt(self, key: str, why: str) -> None:
        self.stats.errors += 1
        logger.warning("lmcache backend %r: page %s is not valid (%s): miss", self.name, key, why)

    async def _gather(self, jobs: list[Awaitable[Any]]) -> list[Any]:
        return await asyncio.gather(*jobs, return_exceptions=True)

    def _remove_remote(self, keys: list[str]) -> None:
        """Free ``keys`` on the remote: ``remove_sync`` if the connector has it, else tombstones."""
        if not keys:
            return
        if self._can_remove:
            connector = self._connect()
            for i, key in enumerate(keys):
                try:
                    connector.remove_sync(self._lm_key(key))
                except NotImplementedError:
                    self._can_remove = False
                    keys = keys[i:]
                    break
                except Exception as exc:
                    self.stats.errors += 1
                    raise BackendUnavailableError(
                        f"lmcache backend {self.name!r}: remove failed: {exc!r}"
                    ) from exc
            else:
                return
        self._write({key: None for key in keys})

    def _write(self, pages: Mapping[str, Buffer | None]) -> None:
        """Write pages (None: a tombstone) in one LMCache batch; raise if any failed."""
        keys = [self._lm_key(key) for key in pages]
        objs = [
            self._memory_obj(key, _KIND_TOMBSTONE, b"")
            if data is None
            else self._memory_obj(key, _KIND_PAGE, data)
            for key, data in pages.items()
        ]

        async def put(connector: Any) -> None:
            # Not connector.batched_put: LMCache's InstrumentedRemoteConnector.batched_put logs
            # and swallows errors. One put() coroutine per value, all in flight at once.
            results = await self._gather([connector.put(k, o) for k, o in zip(keys, objs, strict=True)])
            for result in results:
                if isinstance(result, BaseException):
                    raise result

        self._run(put, f"put of {len(keys)} value(s)")
        self._expire(list(pages))

    # -- Backend API -----------------------------------------------------------------------

    def _put_batch(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        results: list[bool] = []
        with self._lock:
            self._check_open()  # close() may have run while this call waited for the lock
            before = set(self._pages)
            latest: dict[str, Buffer] = {}
            evicted: list[str] = []
            stored_sizes: list[int] = []
            for key, buf in items:  # plan on the index, in input order (like the cpu pool)
                size = memoryview(buf).nbytes
                victims = self._pages.put(key, size, None)
                if victims is None:
                    self.stats.put_refused += 1
                    results.append(False)
                    continue
                for victim in victims:
                    latest.pop(victim.key, None)
                    evicted.append(victim.key)
                self._record_evictions(victims)
                latest[key] = buf
                stored_sizes.append(size)
                results.append(True)
            # Free what was stored before this call and is gone now; write the survivors.
            stale = [key for key in dict.fromkeys(evicted) if key in before and key not in latest]
            try:
                if latest:
                    self._write(latest)
                self._remove_remote(stale)
            except BackendUnavailableError:
                for key in latest:
                    self._forget(key)  # remote state unknown: not stored as far as we know
                raise
            self.stats.puts += len(stored_sizes)
            self.stats.put_bytes += sum(stored_sizes)
        return results

    def _get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            self._check_open()
            self.stats.gets += len(keys)
            wanted = [key for key in dict.fromkeys(keys) if key in self._pages]
            found: dict[str, bytes | None] = {}
            if wanted:
                lm_keys = [self._lm_key(key) for key in wanted]

                async def get(connector: Any) -> list[Any]:
                    return await self._gather([connector.get(k) for k in lm_keys])

                raw = self._run(get, f"get of {len(wanted)} value(s)")
                errors = [r for r in raw if isinstance(r, BaseException)]
                unavailable = [r for r in errors if not isinstance(r, ValueError | KeyError | struct.error)]
                if unavailable:
                    self.stats.errors += 1
                    raise BackendUnavailableError(
                        f"lmcache backend {self.name!r}: get failed: {unavailable[0]!r}"
                    ) from unavailable[0]
                for key, result in zip(wanted, raw, strict=True):
                    if isinstance(result, BaseException):  # LMCache's two keys disagree
                        self._corrupt(key, f"LMCache read failed: {result!r}")
                        data = None
                    else:
                        data = self._unwrap(key, result)
                    found[key] = data
                    entry = self._pages.touch(key)
                    if data is None or entry is None or len(data) != entry.size:
                        found[key] = None
                        self._forget(key)  # the remote lost it (or holds another version)
                self._expire([key for key in wanted if found[key] is not None])
            results = [found.get(key) for key in keys]
            for data in results:
                if data is not None:
                    self.stats.hits += 1
                    self.stats.get_bytes += len(data)
        return results

    def _delete_batch(self, keys: Sequence[str]) -> int:
        with self._lock:
            self._check_open()
            present = [key for key in dict.fromkeys(keys) if key in self._pages]
            for key in present:
                self._forget(key)
            self._remove_remote(present)
            return len(present)

    def _close(self) -> None:
        """Close LMCache's connector, waiting at most ``close_timeout_s``."""
        locked = self._lock.acquire(timeout=self._close_timeout)  # a call in flight ends by then
        try:
            self._clear_index()
            connector, self._connector = self._connector, None
        finally:
            if locked:
                self._lock.release()
        with contextlib.suppress(Exception):
            self._expiry.close()
        done = True
        if connector is not None:
            future = asyncio.run_coroutine_threadsafe(connector.close(), self._loop)
            try:
                future.result(timeout=self._close_timeout)
            except TimeoutError:
                done = False
                logger.warning(
                    "lmcache backend %r: LMCache connector close() did not finish in %g s "
                    "(known hang of its Redis connector); abandoning its I/O thread",
                    self.name,
                    self._close_timeout,
                )
            except Exception as exc:
                logger.warning("lmcache backend %r: LMCache close() failed: %r", self.name, exc)
        if done:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=self._close_timeout)
            if not self._thread.is_alive():
                with contextlib.suppress(Exception):
                    self._loop.close()
