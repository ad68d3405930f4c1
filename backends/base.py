"""The one storage interface every hybrid-offload backend implements.

A backend stores opaque, self-describing page bytes (see ``hybrid_offload.core.page_format``)
under keys made by the planner. It never interprets page bytes: verification happens in the
page decoder of whoever reads them.

Contract (every backend, checked by ``tests/contract``):

* **Keys** are ASCII strings matching :data:`KEY_PATTERN` (lowercase hex, ``-`` separated
  namespace and digest). Anything else raises :class:`InvalidKeyError` before any I/O, so no
  key can reach outside the backend's storage (paths, Redis key space).
* **Batch calls.** ``put_batch``, ``get_batch``, ``get_into``, ``contains_batch`` and
  ``delete_batch`` take many keys at once and answer per key, in input order. Backends batch
  their I/O (one pipeline, one lock acquisition, one thread-pool round) per call.
* **Atomic pages.** A page is either fully visible with the exact bytes put, or absent. A
  reader never sees a partial page, also after a crash mid-write.
* **Puts never raise for capacity.** A page that does not fit (larger than the capacity) is
  refused (``False``); otherwise older pages are evicted (LRU by last put/get) to make room.
  Re-putting an existing key replaces its bytes and refreshes it.
* **Misses are normal.** ``get_batch`` returns ``None`` for an absent key; evicted, expired or
  deleted keys are misses. Only a broken backend (server down, I/O error on the medium) raises
  :class:`BackendUnavailableError`; callers turn that into misses and back off.
* **Blocking.** Every method may block on I/O. The connector calls them from its own I/O
  thread on the worker side, and ``contains_batch`` from the scheduler's lookup path; none of
  them is called on vLLM's forward path.
* **Threading.** All methods are thread-safe; a backend may be used from several threads.
* **Ownership.** ``put_batch`` copies what it needs before returning: the caller may reuse
  its buffers at once. ``get_into`` writes into caller-owned buffers and keeps no reference.
  The one exception is a call that raises :class:`BuffersInUseError`: its buffers may still be
  read or written, and the caller must never reuse them.
* **Visibility across processes.** ``shared_index`` says whether another process (vLLM's
  scheduler process) opening the same backend config sees the pages this process put. When
  it is False (the in-process cpu pool), the connector mirrors the index from worker reports.
* ``close()`` releases resources, is idempotent and bounded in time; later calls raise
  :class:`BackendClosedError`.
* **Recency (optional).** ``touch_batch(keys)`` makes stored keys the most recently used, in
  order, without reading them (the connector keeps a prefix more recent than the pages that
  need it). Backends whose LRU it refreshes say so with ``touch_refreshes = True``; the others
  ignore it.
* **Retention hints (optional).** ``describe_batch(hints)`` says what each page about to be
  put is for (:class:`~.retention.Retention`: its resume-point chain, its weight), so a backend
  whose eviction can use it (``cpu``, ``disk``: :class:`~.retention.ResumePointPolicy`) keeps
  it for the key's next put; the others ignore it. It never fails a store.
* **Pages in place (optional).** ``lease_batch(keys)`` lends stored pages as read-only views of
  the backend's own memory (:class:`PageLease`: no copy; a page stays as it is, and its memory
  is not reused, until the lease is released), and ``reserve_batch(keys, sizes)`` hands out
  writable memory for pages that become visible only when committed
  (:class:`PageReservation`). Backends whose pages live in memory this process can address
  (the cpu tier's arena) say so with ``in_place = True`` and expose that memory as
  ``arena``; for the others the defaults copy (``get_batch``, ``put_batch``), so every backend
  offers both calls.
* **Listing (optional).** ``scan(prefix)`` yields a :class:`PageInfo` per stored page whose key
  starts with ``prefix`` (for tools such as ``hybrid-offload cache``; the connector never calls
  it). Backends that cannot list raise ``NotImplementedError``. See :meth:`Backend.scan`.

Implementing a backend (a built-in type, or a user's ``type: "pkg.mod:Class"``): subclass
:class:`Backend`. Its public methods check the keys (or prefix, or buffer lengths) and that the
backend is open, once, then call the method of the same name with a leading ``_``. A subclass
implements ``_put_batch``, ``_get_batch``, ``_contains_batch``, ``_delete_batch``,
``_used_bytes`` and ``_close`` (run by the first ``close()`` only), and where the defaults do
not fit ``_get_into``, ``_get_prefix``, ``_touch_batch``, ``_scan``, ``take_evicted`` and
``prepare_data_path``. One with a lock of its own calls ``_check_open()`` again under it where
a call racing ``close()`` must not go on. Backends keeping their own index of pages use
:class:`~.lru_index.LruIndex`.
"""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from .retention import Retention

# ``\Z``, not ``$``: ``$`` also matches before a trailing newline ("...\n" would pass).
KEY_PATTERN = re.compile(r"\A[0-9a-f]{8,64}-[0-9a-f]{8,64}\Z")
#: what may start a key: a (partial) namespace, optionally ``-`` and a (partial) digest
KEY_PREFIX_PATTERN = re.compile(r"\A[0-9a-f]{0,64}(?:-[0-9a-f]{0,64})?\Z")

Buffer = bytes | bytearray | memoryview


class BackendError(Exception):
    """Base class of backend errors."""


class InvalidKeyError(BackendError, ValueError):
    """A key does not match :data:`KEY_PATTERN`."""


class BackendUnavailableError(BackendError):
    """The medium or server cannot be reached or failed; the call's pages are misses."""


class BuffersInUseError(BackendUnavailableError):
    """The call failed and a transfer of it could not be stopped: the buffers it was given
    (``put_batch``'s pages, ``get_into``'s destinations) may still be read or written. The
    caller must never reuse them (the ownership clause cannot hold for this call)."""


class BackendClosedError(BackendError):
    """The backend was used after ``close()``."""


class BackendConfigError(ValueError):
    """A backend's configuration is invalid; the message names the offending key."""


@dataclass(frozen=True)
class BackendConfig:
    """Validated configuration of one backend instance: what it stores and where.

    ``options`` holds the type-specific keys, already checked by the backend class's
    :meth:`Backend.validate_options`. How the connector uses the backend (load weight,
    backoff, store policy) is not here: see ``TierPolicy`` in ``hybrid_offload.connector.config``.
    """

    type: str
    name: str
    capacity_bytes: int
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class BackendStats:
    """Plain counters a backend keeps about itself (never negative)."""

    puts: int = 0
    put_bytes: int = 0
    put_refused: int = 0
    gets: int = 0
    hits: int = 0
    get_bytes: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    errors: int = 0


class PageLease:
    """Stored pages lent by :meth:`Backend.lease_batch`, in the order of the keys asked for.

    ``views[i]`` is page ``i``'s bytes (a read-only memoryview; None: a miss), valid until
    :meth:`release`. Where the backend lends in place, ``offsets[i]`` is where the page starts
    in ``memory`` (the backend's ``arena``), so that pages side by side can be copied as one;
    else ``memory`` is None. :meth:`release` is idempotent; a lease never released keeps its
    pages' memory from being reused (never their keys from being evicted or replaced).
    """

    def __init__(
        self,
        views: list[memoryview | None],
        offsets: list[int | None] | None = None,
        memory: memoryview | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.views = views
        self.offsets = offsets if offsets is not None else [None] * len(views)
        self.memory = memory
        self._release = release
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            release, self._release = self._release, None
        if release is not None:
            release()


class PageReservation:
    """Memory for pages that become visible only when committed (:meth:`Backend.reserve_batch`).

    ``views[i]`` is writable memory of exactly the size asked for key ``i`` (None: refused, as
    ``put_batch`` refuses a page), at ``offsets[i]`` in ``memory`` where the backend reserves in
    place (else ``memory`` is None). :meth:`commit` publishes the pages whose ``ok`` is True (all
    when None), replacing older versions and evicting by LRU as ``put_batch`` does, and returns
    per key whether it is stored now; :meth:`abort` (or a commit of none) frees the rest. Only
    the first of the two calls does anything.
    """

    def __init__(
        self,
        views: list[memoryview | None],
        commit: Callable[[list[bool], list[int] | None], list[bool]],
        offsets: list[int | None] | None = None,
        memory: memoryview | None = None,
    ) -> None:
        self.views = views
        self.offsets = offsets if offsets is not None else [None] * len(views)
        self.memory = memory
        self._commit: Callable[[list[bool], list[int] | None], list[bool]] | None = commit
        self._lock = threading.Lock()
        self._after: list[Callable[[], None]] = []

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the pages are committed (a wrapper's bookkeeping)."""
        self._after.append(fn)

    def commit(self, ok: Sequence[bool] | None = None, order: Sequence[int] | None = None) -> list[bool]:
        """Publish the pages whose ``ok`` is True (all when None) in ``order`` (indices; None:
        the keys' order), as ``put_batch`` would in that order; per key, whether it is stored."""
        flags = [v is not None for v in self.views] if ok is None else [
            bool(o) and v is not None for o, v in zip(ok, self.views, strict=True)]  # fmt: skip
        with self._lock:
            commit, self._commit = self._commit, None
        if commit is None:
            return [False] * len(self.views)
        out = commit(flags, None if order is None else list(order))
        for fn in self._after:
            fn()
        return out

    def abort(self) -> None:
        self.commit([False] * len(self.views))


@dataclass(frozen=True)
class PageInfo:
    """One stored page as :meth:`Backend.scan` lists it.

    ``size`` is the page's length in bytes. ``mtime`` is a wall-clock time (seconds since the
    epoch) of the page's last use as the backend's LRU knows it: its last put or get (which one
    a backend records is in its ``scan`` docstring), or None when the backend does not know.
    """

    key: str
    size: int
    mtime: float | None = None


def check_prefix(prefix: str) -> None:
    """Raise :class:`InvalidKeyError` unless ``prefix`` can start a well-formed key."""
    if not isinstance(prefix, str) or KEY_PREFIX_PATTERN.fullmatch(prefix) is None:
        raise InvalidKeyError(
            f"invalid key prefix {prefix!r}: expected lowercase hex, optionally '-' and more hex"
        )


def check_keys(keys: Sequence[str]) -> None:
    """Raise :class:`InvalidKeyError` naming the first key that is not well formed."""
    for key in keys:
        if not isinstance(key, str) or KEY_PATTERN.fullmatch(key) is None:
            raise InvalidKeyError(f"invalid page key {key!r}: expected <hex>-<hex>")


class Backend(ABC):
    """A page store. See the module docstring for the full contract."""

    #: registry name, the ``type`` in config
    type_name: ClassVar[str]
    #: whether another process opening the same config sees this process's pages
    shared_index: ClassVar[bool] = True
    #: tier reported to vLLM's prompt-tokens-by-source metric: "host", "disk", "p2p" or
    #: "external_unspecified" (vllm.v1.metrics.cache_hit_source.CacheHitSource values)
    hit_source: ClassVar[str] = "external_unspecified"
    #: whether :meth:`touch_batch` refreshes this backend's LRU (else it is a no-op)
    touch_refreshes: ClassVar[bool] = False
    #: type-specific option names and their defaults; anything else is rejected
    option_defaults: ClassVar[dict[str, Any]] = {}
    #: whether :meth:`lease_batch` and :meth:`reserve_batch` work in the backend's own memory
    #: (its ``arena``, a writable memoryview) instead of copying
    in_place: ClassVar[bool] = False

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.stats = BackendStats()
        self._closed = False  # set once by close()
        self._close_lock = threading.Lock()

    @classmethod
    def validate_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """Return options with defaults filled in; raise BackendConfigError naming a bad key."""
        unknown = sorted(set(options) - set(cls.option_defaults))
        if unknown:
            allowed = ", ".join(sorted(cls.option_defaults)) or "none"
            raise BackendConfigError(
                f"backend type {cls.type_name!r}: unknown key(s) {unknown} (allowed: {allowed})"
            )
        return {**cls.option_defaults, **options}

    @classmethod
    def implementation(cls, options: dict[str, Any]) -> type[Backend]:
        """The class serving these validated options: ``cls``, unless the type offers several
        layouts (disk: ``layout: segments``)."""
        return cls

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def capacity_bytes(self) -> int:
        return self.config.capacity_bytes

    # -- the public methods: contract checks once, then the subclass's ``_`` method ----------

    def put_batch(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store pages; per item True if stored, False if refused (too large, backend full)."""
        check_keys([key for key, _ in items])
        self._check_open()
        return self._put_batch(items)

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """Return each page's bytes, or None for a miss."""
        check_keys(keys)
        self._check_open()
        return self._get_batch(keys)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        """Read each page into the caller's buffer; return its length, or None for a miss.

        A page larger than its buffer is a miss (the caller sized buffers from the expected
        page size, so a larger page is not the page it wants).
        """
        if len(keys) != len(buffers):
            raise ValueError("get_into: keys and buffers differ in length")
        for i, buf in enumerate(buffers):
            if memoryview(buf).readonly:
                raise ValueError(f"get_into: buffer {i} is read-only")
        check_keys(keys)
        self._check_open()
        return self._get_into(keys, buffers)

    def get_prefix(self, keys: Sequence[str], nbytes: int, sizes: Sequence[int]) -> list[bytes | None]:
        """The first ``nbytes`` bytes of each page (all of a shorter one), or None for a miss.

        For tools that read page headers only (``hybrid-offload cache stats``); ``sizes`` are
        the pages' sizes as :meth:`scan` listed them. Optional (see :meth:`_get_prefix`). Does
        not need to refresh recency.
        """
        if len(keys) != len(sizes) or nbytes < 1:
            raise ValueError("get_prefix: keys and sizes differ in length, or nbytes < 1")
        check_keys(keys)
        self._check_open()
        return self._get_prefix(keys, nbytes, sizes)

    def lease_batch(self, keys: Sequence[str]) -> PageLease:
        """Lend each stored page (see :class:`PageLease`); misses are None."""
        check_keys(keys)
        self._check_open()
        return self._lease_batch(keys)

    def reserve_batch(self, keys: Sequence[str], sizes: Sequence[int]) -> PageReservation:
        """Memory for pages of ``sizes`` bytes under ``keys`` (see :class:`PageReservation`)."""
        if len(keys) != len(sizes) or any(n < 0 for n in sizes):
            raise ValueError("reserve_batch: keys and sizes differ in length, or a size is negative")
        check_keys(keys)
        self._check_open()
        return self._reserve_batch(keys, sizes)

    def contains_batch(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored now (a later get may still miss after eviction)."""
        check_keys(keys)
        self._check_open()
        return self._contains_batch(keys)

    def delete_batch(self, keys: Sequence[str]) -> int:
        """Delete pages; return how many existed."""
        check_keys(keys)
        self._check_open()
        return self._delete_batch(keys)

    def touch_batch(self, keys: Sequence[str]) -> None:
        """Make each stored key in ``keys`` the most recently used, in order (the last key ends
        most recent), without reading it; keys not stored are ignored. Optional (see
        :meth:`_touch_batch`)."""
        check_keys(keys)
        self._check_open()
        self._touch_batch(keys)

    def describe_batch(self, hints: Sequence[tuple[str, Retention]]) -> None:
        """What each key about to be put is for; optional (see :meth:`_describe_batch`)."""
        check_keys([key for key, _ in hints])
        self._check_open()
        self._describe_batch(hints)

    def used_bytes(self) -> int:
        """Bytes of page data held now."""
        self._check_open()
        return self._used_bytes()

    def state_bytes(self) -> int | None:
        """Of :meth:`used_bytes`, the bytes of recurrent-state pages as retention hints told
        them (:meth:`describe_batch`); None where the backend does not tell them apart."""
        self._check_open()
        return self._state_bytes()

    def scan(self, prefix: str = "") -> Iterator[PageInfo]:
        """Yield a :class:`PageInfo` for every page whose key starts with ``prefix``.

        Optional (see :meth:`_scan`). Used by maintenance tools (``hybrid-offload cache``),
        never by the connector. A generator: every error, the checks' included, surfaces
        from ``next()``.

        * **Prefix.** ``prefix`` must match :data:`KEY_PREFIX_PATTERN` (e.g. a fingerprint, or
          ``"<fingerprint>-"``), else :class:`InvalidKeyError` is raised before any I/O.
        * **Order** is unspecified; every key is listed at most once per scan.
        * **Consistency.** Not a snapshot: a page present for the whole scan is listed exactly
          once; a page put, evicted or deleted while the scan runs may or may not be listed
          (so a later get may miss a listed page).
        * **Recency.** Listing does not refresh any page's LRU position or ``mtime``.
        * **Blocking / threading.** Implementations are generators that block on I/O as they
          go (pages are read from the medium or server in bounded batches, so memory does not
          grow with the number of pages beyond what deduplication needs). They hold no backend
          lock between yields: other threads may use the backend while a scan is suspended.
          Errors surface from ``next()``: :class:`BackendUnavailableError` when the medium or a
          server fails, :class:`BackendClosedError` after ``close()``.
        """
        check_prefix(prefix)
        self._check_open()
        yield from self._scan(prefix)

    def close(self) -> None:
        """Release resources; idempotent (only the first call runs :meth:`_close`); bounded in
        time. Every later call of the methods above raises :class:`BackendClosedError`."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._close()

    def _check_open(self) -> None:
        """Raise :class:`BackendClosedError` once :meth:`close` has begun (subclasses call it
        again under their own lock where a call racing ``close()`` must not go on)."""
        if self._closed:
            raise BackendClosedError(f"{self.type_name} backend {self.name!r} is closed")

    # -- what a subclass implements (keys checked, ``close()`` not called yet) --------------

    @abstractmethod
    def _put_batch(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """:meth:`put_batch`."""

    @abstractmethod
    def _get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """:meth:`get_batch`."""

    def _get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        """:meth:`get_into` (``keys`` and ``buffers`` of equal length). The default copies
        from :meth:`_get_batch`."""
        sizes: list[int | None] = []
        for data, buf in zip(self._get_batch(keys), buffers, strict=True):
            view = memoryview(buf).cast("B")
            if data is None or len(data) > view.nbytes:
                sizes.append(None)
                continue
            view[: len(data)] = data
            sizes.append(len(data))
        return sizes

    def _get_prefix(self, keys: Sequence[str], nbytes: int, sizes: Sequence[int]) -> list[bytes | None]:
        """:meth:`get_prefix` (arguments checked). Backends that can read a byte range read
        only those bytes (redis: GETRANGE); the default reads each whole page into a buffer of
        its listed size with :meth:`_get_into` (a page now larger is a miss), so memory is
        bounded by ``sum(sizes)``."""
        buffers = [memoryview(bytearray(size)) for size in sizes]
        got = self._get_into(keys, buffers)
        return [
            None if n is None else bytes(buf[: min(n, nbytes)]) for n, buf in zip(got, buffers, strict=True)
        ]

    def _lease_batch(self, keys: Sequence[str]) -> PageLease:
        """:meth:`lease_batch`; the default lends copies (:meth:`_get_batch`)."""
        return PageLease([None if data is None else memoryview(data) for data in self._get_batch(keys)])

    def _reserve_batch(self, keys: Sequence[str], sizes: Sequence[int]) -> PageReservation:
        """:meth:`reserve_batch`; the default hands out fresh buffers (refusing pages larger
        than the capacity) and commits them with :meth:`put_batch` (so the wrappers see the
        put)."""
        views: list[memoryview | None] = [
            None if n > self.capacity_bytes else memoryview(bytearray(n)) for n in sizes]  # fmt: skip

        def commit(ok: list[bool], order: list[int] | None) -> list[bool]:
            seq = order if order is not None else range(len(keys))
            idx = [i for i in seq if ok[i] and views[i] is not None]
            stored = self.put_batch([(keys[i], views[i]) for i in idx]) if idx else []  # type: ignore[misc]
            out = [False] * len(keys)
            for i, s in zip(idx, stored, strict=True):
                out[i] = s
            return out

        return PageReservation(views, commit)

    @abstractmethod
    def _contains_batch(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`contains_batch`."""

    @abstractmethod
    def _delete_batch(self, keys: Sequence[str]) -> int:
        """:meth:`delete_batch`."""

    def _touch_batch(self, keys: Sequence[str]) -> None:
        """:meth:`touch_batch`; the default does nothing (``touch_refreshes = False``)."""
        return

    def _describe_batch(self, hints: Sequence[tuple[str, Retention]]) -> None:
        """:meth:`describe_batch`; the default ignores the hints."""
        return

    @abstractmethod
    def _used_bytes(self) -> int:
        """:meth:`used_bytes`."""

    def _state_bytes(self) -> int | None:
        """:meth:`state_bytes`; the default does not know (None)."""
        return None

    def _scan(self, prefix: str) -> Iterator[PageInfo]:
        """:meth:`scan` (the prefix checked); the default raises ``NotImplementedError``
        naming the backend type (backends that cannot list)."""
        raise NotImplementedError(
            f"backend type {self.type_name!r} ({type(self).__name__}) cannot list its pages"
        )

    @abstractmethod
    def _close(self) -> None:
        """:meth:`close`, run once; later calls of the public methods already raise."""

    # -- optional, called as they are ----------------------------------------------------------

    def prepare_data_path(self) -> None:
        """Do one-time data-path setup now rather than in the first put or get (e.g. register
        transfer memory, handshake with servers). Called once by the connector's worker on a
        background thread; may block; a :class:`BackendError` is logged there, never fatal."""
        return  # most backends have nothing to set up

    def take_evicted(self) -> list[str]:
        """Keys evicted or deleted since the last call (for index mirrors; may be empty).

        Backends with ``shared_index = False`` must implement it: the connector forwards these
        keys to the scheduler process so its mirror of this backend's index stays exact.
        """
        return []

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
