"""Redis and Redis Cluster page stores, shared by every process using the same server.

Role: hold pages in a Redis server (type ``redis``) or a Redis Cluster (type
``redis-cluster``, or type ``redis`` with a ``redis+cluster://`` / ``rediss+cluster://`` url),
bounded by ``capacity_bytes`` with an exact LRU shared by all clients of the same ``prefix``.

Contract beyond :mod:`hybrid_offload.backends.base`:

* **Layout.** One Redis string per page, the page bytes as given, at ``<prefix>:p:<key>``
  (keys start with the model fingerprint, so pages are namespaced by fingerprint). The
  capacity/LRU index lives in four keys with one hash tag, ``{<prefix>:idx}:lru|size|used|
  tick`` (see :mod:`hybrid_offload.backends.redis.index`): in a cluster the index is one slot
  while pages spread over all nodes. ``ttl_s`` sets an expiry on pages (from their last put).
  A page is SET with an expiry (``orphan_ttl_s``) lifted once its put is accounted, so a
  client dying between the two leaves no page that nothing would ever evict.
* **Atomic pages.** A page is one SET, so readers see all of it or nothing.
* **Bounded reads.** A get reads a page with GETRANGE up to its limit (``get_into``: the
  buffer; ``get_batch``: ``capacity_bytes``, no put stores more): a longer value (garbage, or
  another writer's) is a miss, and the server never sends more than limit + 1 bytes of it
  (:mod:`.reads`).
* **Capacity and LRU** are shared (``shared_index = True``): a put SETs the pages, then one
  script accounts them and evicts least recently used pages (of any client) until ``used <=
  capacity_bytes``; this client then DELs the victims. The capacity enforced is that of the
  client putting. Gets and ``touch_batch`` refresh recency; ``contains_batch`` does not. A
  page larger than the capacity is refused before any I/O; a page the server refuses (``maxmemory`` with
  ``noeviction``: OOM) is refused too, never raised.
* **Misses and hits heal the index.** Pages can vanish behind the index (server
  ``maxmemory`` eviction, TTL expiry, another client's delete). A get that misses a page still
  indexed (and not re-put since the get began) forgets it, so ``used_bytes`` recovers. A get
  that hits a page the index does not know (an orphan: the server dropped index keys, or a
  client died between SET and accounting) adopts it if it fits under the capacity (it keeps
  its expiry, if any: an orphan of a dead client still expires after ``orphan_ttl_s``). Between processes a
  few races remain (a delete racing a re-put); they are healed the same way on the next get.
* **Server memory limits.** With ``maxmemory``, prefer ``volatile-lru`` (or
  ``volatile-ttl``) with ``ttl_s`` set: only pages carry a TTL, so the server never evicts
  the index. Under ``allkeys-*`` policies it may evict an index key; the scripts then rebuild
  ``used`` or repair the index (at most once per ``HEAL_EVERY_S``, 60 s, per server: any writer
  can fake damage) and let the next put rebuild it from a SCAN of the pages (adopting those still
  stored, evicting down to the capacity), at most once per ``REBUILD_EVERY_S`` (60 s) per
  process: any writer can raise the rebuild flag. With ``noeviction``, a full server refuses puts.
* **Batches.** Every call pipelines its commands (in a cluster: one pipeline per node,
  redis-py's ``ClusterPipeline``) in chunks of at most ``max_batch_bytes`` of values. A get is
  three round trips (index snapshot, GETRANGEs, refresh; one more when a page is absent or
  empty; ``get_into`` from a ``redis://`` server receives the values into the caller's
  buffers on connections of its own, :mod:`.raw`), a put three (SETs, accounting, DEL
  of victims with lifting of expiries), contains one, delete two.
* **Failures.** Construction never connects (the cluster client is built on first use).
  Connection errors, timeouts, cluster-down, loading, authentication (a wrong password is
  only seen on first use, so it is reported as unavailable, the message says
  "authentication failed") and any other server error raise :class:`BackendUnavailableError`
  naming the backend and the url (never a password), count ``stats.errors``, and are logged
  (warning on the first failure, info on recovery). redis-py reconnects on the next call.
  A round trip is bounded by ``connect_timeout_s + socket_timeout_s``, with one immediate
  retry on a dropped connection (a server that restarted); a call makes at most three per
  chunk of ``max_batch_bytes``.
* **Options**: see :mod:`hybrid_offload.backends.redis.options` (the password comes from
  ``password_file`` / ``password_env`` only; a password in ``url`` is refused).
* **Threading / blocking.** Methods block on network I/O and are thread-safe (a pool of at
  most ``max_connections`` connections per server; waiting for one is bounded too). Puts and
  deletes of one instance hold one lock, so this process never DELs a page that another of
  its threads just re-put. ``put_batch`` sends the caller's buffers before returning and keeps
  no reference; ``get_batch`` returns fresh ``bytes``.
* **Listing.** ``scan`` walks the page keys with SCAN ``MATCH <prefix>:p:<key prefix>*`` (never
  KEYS; in a cluster, every primary), about 1000 keys per round trip. ``size`` comes from the
  shared index's size hash (STRLEN only for pages the index does not know), ``mtime`` from
  OBJECT IDLETIME: the server's last read or write of the page, 1 s resolution, None under an
  LFU ``maxmemory-policy``. Neither refreshes a page's LRU position or idle time (the STRLEN
  of a page the index does not know counts as a read of it).
* ``close()`` disconnects the pools (bounded, idempotent); later calls raise BackendClosedError.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    AuthenticationError,
    OutOfMemoryError,
    RedisClusterException,
    RedisError,
)
from redis.retry import Retry

from ..base import (
    KEY_PATTERN,
    Backend,
    BackendClosedError,
    BackendConfig,
    BackendUnavailableError,
    Buffer,
    PageInfo,
)
from .index import RedisIndex
from .options import (
    COMMON_DEFAULTS,
    bad_option,
    check_common_options,
    check_url,
    parse_node,
    redact_url,
    redis_password,
)
from .raw import raw_reader_for
from .reads import getrange, getrange_into

__all__ = ["RedisBackend", "RedisClusterBackend"]

logger = logging.getLogger(__name__)

_MAX_KEYS_PER_PIPELINE = 4096
_SCAN_COUNT = 1000  # keys per SCAN round trip and per round of size/idle-time queries
#: a process rebuilds the index from a scan at most this often (see ``_rebuild_due``)
REBUILD_EVERY_S = 60.0
#: bytes per socket read of a reply. Inside an engine the load thread competes for the GIL with
#: vLLM's busy step loop, and every read gives the GIL up for up to the switch interval (5 ms):
#: redis-py's 64 KiB default read 2 MiB pages at ~20 MB/s there, 4 MiB reads at ~280 MB/s.
#: The parser keeps one buffer of this size per connection.
SOCKET_READ_BYTES = 4 << 20


class RedisBackend(Backend):
    """Pages in Redis with a shared capacity/LRU index (see the module docstring)."""

    type_name: ClassVar[str] = "redis"
    shared_index: ClassVar[bool] = True
    touch_refreshes: ClassVar[bool] = True
    option_defaults: ClassVar[dict[str, Any]] = dict(COMMON_DEFAULTS)
    #: whether this type is always a cluster (else: only with a ``+cluster`` url scheme)
    _cluster_type: ClassVar[bool] = False

    @classmethod
    def validate_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """Fill defaults and check every option; raise BackendConfigError naming the key."""
        options = super().validate_options(options)
        check_common_options(options, cluster_only=cls._cluster_type)
        return options

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._options = self.validate_options(dict(config.options))
        opts = self._options
        self._url: str | None = opts["url"]
        self._cluster = self._cluster_type or check_url(self._url, cluster_only=False)
        self._safe_url = redact_url(self._url) if self._url else ",".join(opts["startup_nodes"])
        self._password = redis_password(opts)
        self._prefix: str = opts["prefix"]
        self._index = RedisIndex(self._prefix)
        #: clock of the rebuild rate limit (tests inject one); when this process last rebuilt
        self.clock = time.monotonic
        self._last_rebuild: float | None = None
        ttl = opts["ttl_s"]
        self._ttl_ms: int | None = None if ttl is None else max(1, round(ttl * 1000))
        self._orphan_ttl_ms: int = max(1, round(opts["orphan_ttl_s"] * 1000))
        self._max_batch_bytes: int = opts["max_batch_bytes"]
        self._write_lock = threading.Lock()  # puts and deletes of this instance
        self._client_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._failing = False
        self._client: Any = None if self._cluster else self._make_standalone()
        password = None if self._password is None else self._password.text()
        self._raw = None if self._cluster or self._url is None else raw_reader_for(self._url, password, opts)

    # -- clients ---------------------------------------------------------------------------

    def _connection_kwargs(self) -> dict[str, Any]:
        opts = self._options
        kwargs: dict[str, Any] = {
            "socket_timeout": float(opts["socket_timeout_s"]),
            "socket_connect_timeout": float(opts["connect_timeout_s"]),
            "max_connections": opts["max_connections"],
            "socket_read_size": SOCKET_READ_BYTES,
            # waiting for a pooled connection is bounded like a round trip
            "timeout": float(opts["socket_timeout_s"] + opts["connect_timeout_s"]),
        }
        if opts["ssl_ca_certs"] is not None:
            kwargs["ssl_ca_certs"] = opts["ssl_ca_certs"]
        if self._password is not None:
            kwargs["password"] = self._password.text()
        return kwargs

    def _make_standalone(self) -> redis.Redis:
        """A client on a lazily connecting pool (nothing is sent until the first call)."""
        assert self._url is not None
        pool = redis.BlockingConnectionPool.from_url(
            self._url,
            # one immediate retry on a dropped connection (e.g. the server restarted)
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            **self._connection_kwargs(),
        )
        return redis.Redis(connection_pool=pool)

    def _make_cluster(self) -> RedisCluster:
        """Connect to the cluster (reads its slot map): only called on first use."""
        nodes = [parse_node(n) for n in self._options.get("startup_nodes") or []]
        url = self._url
        if url is None:  # the first startup node as url: redis-py then uses our pool class
            url = f"redis://{nodes[0].host}:{nodes[0].port}"
        scheme, sep, rest = url.partition("://")
        url = scheme.replace("+cluster", "") + sep + rest
        return RedisCluster(
            url=url,
            startup_nodes=nodes,
            retry=Retry(NoBackoff(), 1),
            connection_pool_class=redis.BlockingConnectionPool,
            **self._connection_kwargs(),
        )

    def _redis(self) -> Any:
        """The client; the cluster client is created here, on first use (may raise)."""
        client = self._client
        if client is not None:
            return client
        with self._client_lock:
            self._check_open()
            if self._client is None:
                self._client = self._make_cluster()
            return self._client

    # -- helpers ---------------------------------------------------------------------------

    def _page_key(self, key: str) -> str:
        return f"{self._prefix}:p:{key}"

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    @contextlib.contextmanager
    def _guard(self, op: str) -> Iterator[None]:
        """Turn redis-py failures of ``op`` into BackendUnavailableError (or Closed)."""
        self._check_open()
        try:
            yield
        except (RedisError, RedisClusterException, OSError) as exc:
            if self._closed:
                raise BackendClosedError(
                    f"{self.type_name} backend {self.name!r} was closed during {op}"
                ) from exc
            self._count(errors=1)
            what = (
                "authentication failed (check the user in 'url' and the password in "
                "'password_file' / 'password_env')"
                if isinstance(exc, AuthenticationError)
                else f"{type(exc).__name__}: {exc}"
            )
            message = f"{self.type_name} backend {self.name!r} ({self._safe_url}): {op}: {what}"
            if not self._failing:
                self._failing = True
                logger.warning("%s", message)
            else:
                logger.debug("%s", message)
            raise BackendUnavailableError(message) from exc
        if self._failing:
            self._failing = False
            logger.info("%s backend %r (%s) is reachable again", self.type_name, self.name, self._safe_url)

    def _pipeline(
        self, client: Any, commands: Sequence[tuple[Any, ...]], *, raise_on_error: bool = True
    ) -> list[Any]:
        """Run ``(method, *args)`` commands in one pipeline (a cluster groups them per node)."""
        pipe = client.pipeline(transaction=False)
        for method, *args in commands:
            getattr(pipe, method)(*args)
        return pipe.execute(raise_on_error=raise_on_error)

    def _chunks(self, sizes: Sequence[int]) -> Iterator[range]:
        """Index ranges whose sizes sum to at most ``max_batch_bytes`` (a lone big one alone)."""
        start, total = 0, 0
        for i, size in enumerate(sizes):
            if i > start and (total + size > self._max_batch_bytes or i - start >= _MAX_KEYS_PER_PIPELINE):
                yield range(start, i)
                start, total = i, 0
            total += size
        if start < len(sizes):
            yield range(start, len(sizes))

    # -- Backend API -----------------------------------------------------------------------

    def _put_batch(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store pages in order; False for a page larger than the capacity or refused (OOM)."""
        results = [False] * len(items)
        views: list[tuple[int, str, memoryview]] = []
        for i, (key, buf) in enumerate(items):
            view = memoryview(buf)
            view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
            if view.nbytes > self.capacity_bytes:
                results[i] = False
            else:
                views.append((i, key, view))
        refused = len(items) - len(views)
        with self._write_lock, self._guard("put"):
            client = self._redis()
            for chunk in self._chunks([view.nbytes for _, _, view in views]):
                batch = [views[j] for j in chunk]
                refused += self._put_chunk(client, batch, results)
        self._count(put_refused=refused)
        return results

    def _put_chunk(self, client: Any, batch: list[tuple[int, str, memoryview]], results: list[bool]) -> int:
        """SET, account and evict one chunk (write lock held); return how many were refused.

        Pages are SET with an expiry (``orphan_ttl_s``, or ``ttl_s`` when shorter) that is
        lifted (or set to ``ttl_s``) once they are accounted, in the round trip that DELs the
        victims: a client dying between SET and accounting leaves no page forever.
        """
        ttl, orphan = self._ttl_ms, self._orphan_ttl_ms
        final = ttl is not None and ttl <= orphan  # ttl_s already bounds an orphan's life
        pipe = client.pipeline(transaction=False)
        for _, key, view in batch:
            pipe.set(self._page_key(key), view, px=ttl if final else orphan)
        replies = pipe.execute(raise_on_error=False)
        stored: list[tuple[str, int]] = []
        for (i, key, view), reply in zip(batch, replies, strict=True):
            if isinstance(reply, OutOfMemoryError):
                continue  # the server is full (noeviction): refused, not an error
            if isinstance(reply, Exception):
                raise reply
            stored.append((key, view.nbytes))
            results[i] = True
        if not stored:
            return len(batch)
        victims, rebuild = self._index.account(client, self.capacity_bytes, stored)
        doomed = {key for key, _ in victims}
        commands: list[tuple[Any, ...]] = [("delete", self._page_key(key)) for key in doomed]
        if not final:
            kept = [self._page_key(key) for key, _ in stored if key not in doomed]
            commands += [("persist", k) if ttl is None else ("pexpire", k, ttl) for k in kept]
        if commands:
            self._pipeline(client, commands)
        if victims:
            logger.debug("%s: evicted %d pages", self.name, len(victims))
        self._count(
            puts=len(stored),
            put_bytes=sum(size for _, size in stored),
            evictions=len(victims),
            evicted_bytes=sum(size for _, size in victims),
        )
        if rebuild and self._rebuild_due() and self._index.claim_rebuild(client):
            self._last_rebuild = self.clock()
            self._rebuild_index(client)
        return len(batch) - len(stored)

    def _rebuild_due(self) -> bool:
        """At most one rebuild per ``REBUILD_EVERY_S`` in this process: any writer of the
        server can raise the flag, and a rebuild scans every page (210 ms at 50k pages). The
        flag stays raised meanwhile, for the first put after the interval."""
        return self._last_rebuild is None or self.clock() - self._last_rebuild >= REBUILD_EVERY_S

    def _rebuild_index(self, client: Any) -> None:
        """Rebuild the index from a scan of the pages (write lock held; module docstring)."""
        adopted, victims = self._index.rebuild(
            client, self.capacity_bytes, self._scan_batches(client, ""), self._page_key
        )
        self._count(evictions=len(victims), evicted_bytes=sum(size for _, size in victims))
        logger.warning(
            "%s: the server dropped part of the redis index: rebuilt it from a scan (%d pages "
            "adopted, %d evicted)", self.name, adopted, len(victims),
        )  # fmt: skip

    def _get(self, keys: Sequence[str], limits: Sequence[int], *, unknown_weight: bool,
             into: Sequence[memoryview] | None = None) -> list[Any]:  # fmt: skip
        """Pages of at most ``limits`` bytes; hits refresh recency, stale index entries heal.
        With ``into`` (views of ``limits`` bytes) and the raw reader, hits are received
        straight into the views and returned as views of them.

        A value longer than its limit is a miss, neither healed nor adopted, and the server
        sends at most ``limit + 1`` bytes of it (GETRANGE), so a huge value under a page key
        costs at most its limit. Pipelines are sized by the indexed sizes (by the limit for
        pages the index does not know, with ``unknown_weight``).
        """
        with self._guard("get"):
            client = self._redis()
            scores, sizes = self._index.snapshot(client, keys)
            weights = [
                min(limit, size) if size is not None else limit if unknown_weight else 0
                for limit, size in zip(limits, sizes, strict=True)
            ]
            run, names = functools.partial(self._pipeline, client), [self._page_key(k) for k in keys]
            read: Sequence[Buffer | None]
            if into is not None and self._raw is not None:
                read = getrange_into(run, self._chunks, self._raw, names, into, weights)
            else:
                read = getrange(run, self._chunks, names, limits, weights)
            found = [
                None if data is None or len(data) > limit else data
                for data, limit in zip(read, limits, strict=True)
            ]
            hits = [(key, len(data)) for key, data in zip(keys, found, strict=True) if data is not None]
            heal = [
                (key, score)
                for key, data, score in zip(keys, read, scores, strict=True)
                if data is None and score is not None
            ]
            if hits or heal:
                healed, freed, adopted = self._index.touch(client, self.capacity_bytes, hits, heal)
                if healed or adopted:
                    logger.debug(
                        "%s: forgot %d vanished pages (%d bytes), adopted %d unindexed pages",
                        self.name, healed, freed, adopted,
                    )  # fmt: skip
        self._count(gets=len(keys), hits=len(hits), get_bytes=sum(size for _, size in hits))
        return found

    def _get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each page's bytes or None; a value longer than the capacity (no put stored it) is
        a miss, read no further than that."""
        if not keys:
            return []
        return self._get(keys, [self.capacity_bytes] * len(keys), unknown_weight=False)

    def _get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        """Read each page into its buffer; a page longer than its buffer is a miss, and the
        server sends at most the buffer's size of it."""
        if not keys:
            return []
        views = [memoryview(buf).cast("B") for buf in buffers]
        sizes: list[int | None] = []
        found = self._get(keys, [v.nbytes for v in views], unknown_weight=True, into=views)
        for data, view in zip(found, views, strict=True):
            if isinstance(data, bytes):  # redis-py's path (the raw reader wrote into the view)
                view[: len(data)] = data
            sizes.append(None if data is None else len(data))
        return sizes

    def _get_prefix(self, keys: Sequence[str], nbytes: int, sizes: Sequence[int]) -> list[bytes | None]:
        """The first ``nbytes`` of each page (GETRANGE: only those bytes travel), or None for a
        miss; does not refresh recency; ``sizes`` are not needed."""
        if not keys:
            return []
        with self._guard("get_prefix"):
            run = functools.partial(self._pipeline, self._redis())
            names = [self._page_key(key) for key in keys]
            return getrange(run, self._chunks, names, [nbytes - 1] * len(keys), [nbytes] * len(keys))

    def _contains_batch(self, keys: Sequence[str]) -> list[bool]:
        """Whether each page exists now (EXISTS on the pages; does not refresh recency)."""
        if not keys:
            return []
        with self._guard("contains"):
            client = self._redis()
            found: list[Any] = []
            for chunk in self._chunks([0] * len(keys)):
                found += self._pipeline(client, [("exists", self._page_key(keys[j])) for j in chunk])
        return [bool(n) for n in found]

    def _touch_batch(self, keys: Sequence[str]) -> None:
        """Refresh the indexed pages' LRU ticks, in order (one script, no page I/O)."""
        if not keys:
            return
        with self._guard("touch"):
            self._index.refresh(self._redis(), list(dict.fromkeys(keys)))

    def _delete_batch(self, keys: Sequence[str]) -> int:
        """Delete pages and forget them; return how many pages existed."""
        if not keys:
            return 0
        deleted = 0
        with self._write_lock, self._guard("delete"):
            client = self._redis()
            for chunk in self._chunks([0] * len(keys)):
                deleted += sum(self._pipeline(client, [("delete", self._page_key(keys[j])) for j in chunk]))
            self._index.remove(client, list(dict.fromkeys(keys)))
        return deleted

    def _scan(self, prefix: str) -> Iterator[PageInfo]:
        """Every page whose key starts with ``prefix`` (see "Listing" in the module docstring).

        SCAN may return a key twice (while the server rehashes): keys are deduplicated, at the
        cost of a set of the keys listed so far.
        """
        with self._guard("scan"):
            client = self._redis()
            for keys in self._scan_batches(client, prefix):
                yield from self._describe(client, keys)

    def _scan_batches(self, client: Any, prefix: str) -> Iterator[list[str]]:
        """Page keys starting with ``prefix``, deduplicated, in lists of at most _SCAN_COUNT."""
        skip = len(self._page_key(""))
        seen: set[str] = set()
        batch: list[str] = []
        for name in client.scan_iter(match=self._page_key(prefix) + "*", count=_SCAN_COUNT):
            key = (name.decode() if isinstance(name, bytes) else name)[skip:]
            if key in seen or KEY_PATTERN.fullmatch(key) is None:
                continue  # another prefix's key that happens to match the pattern
            seen.add(key)
            batch.append(key)
            if len(batch) >= _SCAN_COUNT:
                yield batch
                batch = []
        if batch:
            yield batch

    def _describe(self, client: Any, keys: list[str]) -> list[PageInfo]:
        """Size and mtime of listed pages, in one pipeline (two for pages not indexed); pages
        deleted since SCAN listed them are left out."""
        if not keys:
            return []
        pipe = client.pipeline(transaction=False)
        pipe.hmget(self._index.size, keys)
        for key in keys:
            pipe.object("idletime", self._page_key(key))
        sizes, *idles = pipe.execute(raise_on_error=False)
        if isinstance(sizes, Exception):
            raise sizes
        now = time.time()
        present = [i for i, idle in enumerate(idles) if idle is not None]
        unindexed = [i for i in present if sizes[i] is None]
        if unindexed:
            lengths = self._pipeline(client, [("strlen", self._page_key(keys[i])) for i in unindexed])
            for i, length in zip(unindexed, lengths, strict=True):
                sizes[i] = length
        return [
            PageInfo(
                keys[i],
                int(sizes[i]),
                None if isinstance(idles[i], Exception) else now - int(idles[i]),
            )
            for i in present
        ]

    def prepare_data_path(self) -> None:
        """Connect now (PING every node): an unreachable server shows at start-up."""
        with self._guard("connect"):
            self._redis().ping()

    def _used_bytes(self) -> int:
        """Bytes accounted in the shared index (all clients of this prefix)."""
        with self._guard("used_bytes"):
            return self._index.used_bytes(self._redis())

    def _close(self) -> None:
        """Disconnect the pools; bounded (no network round trip)."""
        with self._client_lock:
            client, self._client = self._client, None
        if self._raw is not None:
            self._raw.close()
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
            with contextlib.suppress(Exception):
                if not self._cluster:
                    client.connection_pool.disconnect()


class RedisClusterBackend(RedisBackend):
    """Pages in a Redis Cluster: ``url`` (any node) and/or ``startup_nodes: [host:port]``."""

    type_name: ClassVar[str] = "redis-cluster"
    option_defaults: ClassVar[dict[str, Any]] = {**COMMON_DEFAULTS, "url": None, "startup_nodes": None}
    _cluster_type: ClassVar[bool] = True

    @classmethod
    def validate_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        options = super().validate_options(options)
        nodes = options["startup_nodes"]
        if nodes is not None:
            if not isinstance(nodes, list | tuple) or not nodes:
                raise bad_option("startup_nodes", f"must be a non-empty list of 'host:port', got {nodes!r}")
            for node in nodes:
                parse_node(node)
        elif options["url"] is None:
            raise bad_option("url", "a redis-cluster backend needs 'url' or 'startup_nodes'")
        return options
