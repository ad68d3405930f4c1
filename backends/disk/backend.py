"""Local-disk page store: one file per page, shared by every process opening the same path.

Contract beyond :mod:`hybrid_offload.backends.base`:

* **Layout.** Key ``<namespace>-<digest>`` lives at ``<path>/<namespace>/<digest[:2]>/
  <digest>.page`` (keys are validated first, so none leaves ``path``). Directories get mode
  ``0o700``, files ``0o600``. ``path`` is never re-created after start: if it vanishes (disk
  unmounted) the medium has failed.
* **Atomic pages.** A put writes ``.<digest>.<pid>.<random>.tmp`` beside the page (fsynced if
  ``fsync``), then ``os.replace``-s it onto the page name (with ``fsync``, each directory a put
  renamed into is fsynced once after its renames), so a crash mid-write leaves only a temp
  file, never a visible page. Temp files of dead writers, or older than ten minutes, are
  removed at start. Without ``fsync`` a power loss may leave a page with wrong bytes; the page
  decoder's verification catches that.
* **Index and LRU.** Each instance keeps an index (key -> size, LRU order) rebuilt at start
  by scanning the tree in file-mtime order; puts, gets and touches stamp the file's mtime, so
  the order survives restarts (an instance made with ``touch_on_read=False`` leaves mtimes alone on
  gets: maintenance tools read pages without making them recent).
* **Capacity, across processes.** Page files under ``path`` never exceed ``capacity_bytes`` in
  total, whichever processes wrote them; only temp files of in-flight puts come on top. Every
  process sharing ``path`` keeps one record of that total, ``<path>/.usage``
  (:mod:`.usage`), and changes it under an ``flock`` of ``path`` held around each rename
  of a page into place, each evicting or deleting unlink and each recount, never around page
  data I/O (a batch takes it once). A put that does not fit evicts this process's pages first,
  least recently used resume points first (:class:`~.retention.ResumePointPolicy`); when they
  run out, the tree is walked and every page under ``path`` is a candidate, oldest mtime first.
  The page a put is storing is never evicted for it. The record is raised before a rename and
  lowered after unlinks, so a crash leaves it too high, never too low; each start recounts it
  (also after pages were removed by hand), and a missing or unreadable record is recounted when
  met. Processes may have different capacities: each keeps its own bound on the shared total.
  ``used_bytes`` is this instance's index (its pages, and others' it has seen).
* **Cross-process visibility** (``shared_index = True``). ``contains_batch`` stats the files
  and gets read them, so pages written or deleted by other processes (the worker, seen from
  vLLM's scheduler process) show at once.
* **Threading / blocking.** One lock guards the index and counters. Page data moves outside
  it, through a small thread pool (``io_threads``, :mod:`.io_pool`) for batches of more than a
  few pages, synchronously otherwise (and ``get_into`` while pages are in the page cache).
  Renames and evicting unlinks run under the lock (and the shared ``flock``, taken first), so
  this process's index always matches its files. ``get_into`` reads into the caller's buffers; a
  load of 32 MiB or more, of pages of 512 KiB or more, is cut into ``io_threads`` parts read
  at the same time (one on the calling thread); a page of whole blocks into a block-aligned
  buffer, not in the page cache, is read with ``O_DIRECT`` where the file system takes it
  (:mod:`.direct`).
* **Listing.** ``scan`` walks the directory tree (no lock held; one directory listed at a
  time) and reports each page file's size and mtime (its last put or get); temp files,
  foreign files, links and directories are skipped.
* **Errors.** An ``OSError`` other than "not found" counts in ``stats.errors`` and is logged
  once per (operation, errno); that page is a miss (get) or refused (put, e.g. ``ENOSPC``;
  later puts keep trying). Only when ``path`` itself is gone or unusable does a put or get
  raise :class:`BackendUnavailableError`; so does an untrusted ``.usage`` (a link, another
  owner's file, group- or world-writable: at start, a configuration error naming ``path``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..base import (
    Backend,
    BackendClosedError,
    BackendConfig,
    BackendConfigError,
    BackendUnavailableError,
    Buffer,
    PageInfo,
)
from ..lru_index import LruIndex
from ..retention import ResumePointPolicy, Retention
from .direct import DirectReads
from .files import (
    PageDirs,
    PageStamper,
    counted_size,
    create_temp,
    next_stamp,
    read_exact,
    read_while_cached,
    stat_page,
    touch,
    unlink_page,
    unlink_quietly,
)
from .io_pool import IoPool
from .options import DiskType
from .root import check_writable_root, page_problem, root_problem
from .tree import TMP_SUFFIX, page_paths, scan_pages, walk
from .usage import UnsafeUsageFileError, UsageRecord, locked_usage

__all__ = ["DiskBackend"]

logger = logging.getLogger(__name__)

_POOL_MIN_BATCH = 4  # batches with more pages than this go through the thread pool
# Loads into buffers of _PARALLEL_BYTES or more, of _PARALLEL_PAGE_BYTES or more on average, go
# to the pool at once. Measured warm on 2 cores: below these the per-page syscalls and Python of
# several threads contend, and the calling thread alone was faster.
_PARALLEL_BYTES = 32 << 20
_PARALLEL_PAGE_BYTES = 512 << 10


class DiskBackend(DiskType, Backend):
    """LRU page store on a local file system (see the module docstring)."""

    @classmethod
    def implementation(cls, options: dict[str, Any]) -> type[Backend]:
        """``layout: segments`` is served by :class:`.segments.SegmentDiskBackend`."""
        if options.get("layout") == "segments":
            from .segments import SegmentDiskBackend

            return SegmentDiskBackend
        return cls

    def __init__(self, config: BackendConfig, *, touch_on_read: bool = True) -> None:
        """Open ``path`` (created if missing) and index it; blocks for the scan.

        ``touch_on_read=False`` (maintenance tools, not a config option): gets leave the files'
        mtimes alone, so reading pages does not make them recent.
        """
        super().__init__(config)
        opts = self.validate_options(dict(config.options))
        self._root = os.path.abspath(opts["path"])
        self._fsync: bool = opts["fsync"]
        self._touch_on_read = touch_on_read
        self._dirs = PageDirs(self._root)  # read-only descriptors of page directories
        self._lock = threading.RLock()
        self._retention = ResumePointPolicy(lambda: self._index.capacity)
        self._index: LruIndex[None] = LruIndex(self.capacity_bytes, self._retention)  # the shared total
        self._empty_root: tuple[int, int] | None = None  # (dev, ino) of a root counted empty
        self._pool = IoPool(  # page I/O threads, started on first use
            opts["io_threads"], f"disk-{self.name}", self._check_open, min_batch=_POOL_MIN_BATCH
        )
        self._stamper = PageStamper(self._dirs, self.name)  # read pages' mtimes, off the read path
        self._logged: set[tuple[str, int | None]] = set()
        self._reads = DirectReads(self.name)  # O_DIRECT where it applies
        check_writable_root(self._root, self.name)
        try:
            with locked_usage(self._root) as usage, self._lock:
                self._recount(usage, clean=True)  # resets drift of crashes and hand edits
                self._make_room(usage, 0)  # the capacity may be smaller than last run's
                usage.write(usage.total or 0)
        except UnsafeUsageFileError as exc:
            raise BackendConfigError(f"disk backend {self.name!r}: option 'path': {exc}") from exc
        except OSError as exc:
            raise BackendUnavailableError(
                f"disk backend {self.name!r}: cannot open {self._root!r}: {exc}"
            ) from exc
        logger.info("disk backend %r: %d pages in %s", self.name, len(self._index), self._root)

    # -- start-up --------------------------------------------------------------------------

    def _recount(self, usage: UsageRecord, skip: str | None = None, clean: bool = False) -> None:
        """Walk the tree (the usage lock and ``_lock`` held): index every page file (also other
        processes' pages, oldest first) but ``skip``, and store the exact total in ``usage``;
        with ``clean``, dead writers' temp files are removed."""
        pages = scan_pages(self._walk, self.name, clean)
        self._index.clear()
        for _, key, size in pages:
            if key != skip:
                self._index.insert(key, size, None)
        usage.total = sum(size for _, _, size in pages)
        usage.write(usage.total)
        self._empty_root = None if usage.exists else usage.root_id

    def _walk(
        self,
        prefix: str,
        on_tmp: Callable[[os.DirEntry[str]], None] | None = None,
        on_dir: Callable[[str], None] | None = None,
    ) -> Iterator[tuple[str, os.stat_result]]:
        """(key, stat) of every page file whose key starts with ``prefix`` (see :mod:`.tree`)."""
        return walk(self._root, prefix, on_tmp, on_dir)

    # -- helpers ---------------------------------------------------------------------------

    def _check_root(self) -> None:
        """Raise BackendUnavailableError if the root is no longer trusted (a vanished root is
        left to the per-page outcomes)."""
        try:
            problem = root_problem(self._root)
        except FileNotFoundError:
            return
        except OSError as exc:
            problem = str(exc)
        if problem is not None:
            raise BackendUnavailableError(f"disk backend {self.name!r}: {problem}")

    def _paths(self, key: str) -> tuple[str, str]:
        """(directory, page file) of a validated key."""
        return page_paths(self._root, key)

    def _fail_if_medium_gone(self, outcomes: Sequence[object], access: int) -> None:
        """Raise BackendUnavailableError if an item failed and ``path`` itself is unusable."""
        errors = [o for o in outcomes if isinstance(o, OSError)]
        if not errors:
            return
        try:
            usable = stat.S_ISDIR(os.stat(self._root).st_mode) and os.access(self._root, access)
        except OSError:
            usable = False
        if not usable:
            raise BackendUnavailableError(
                f"disk backend {self.name!r}: {self._root!r} failed: {errors[0]}"
            )

    def _exists(self, key: str) -> bool:
        try:
            st = self._dirs.stat_page(key)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._note_error("stat", self._paths(key)[1], exc)
            return False
        return page_problem(st, self.capacity_bytes) is None

    def _forget_missing(self, keys: Sequence[str]) -> None:
        """Drop indexed keys whose files are gone (deleted by another process)."""
        if keys:
            with self._lock:
                for key in keys:
                    if key in self._index and not self._exists(key):
                        self._index.remove(key)

    def _page_size(self, key: str) -> int:
        """Bytes the key's page file counts in the shared total (0: none, or not a page)."""
        try:
            return counted_size(stat_page(self._root, key))
        except OSError:
            return 0

    def _unlink_page(self, key: str, op: str) -> int | None:
        """Delete a page file (the usage lock held): the bytes it counted, None if not deleted
        (gone already, e.g. evicted by another process; not ours; failed)."""
        try:
            st = unlink_page(self._root, key)
        except OSError as exc:
            self._note_error(op, self._paths(key)[1], exc)
            return None
        return None if st is None else counted_size(st)

    def _known_total(self, usage: UsageRecord, skip: str | None = None) -> bool:
        """Make ``usage.total`` known (locks held); True if the tree was walked for it.

        A missing or unreadable record is recounted, except a missing one where this process
        last counted no pages in this root and has not seen a record since: every writer that
        adds a page creates the record, so none has."""
        if usage.exists:
            self._empty_root = None
        if usage.total is not None:
            return False
        if not usage.exists and self._empty_root == usage.root_id:
            usage.total = 0
            return False
        self._recount(usage, skip)
        return True

    def _make_room(self, usage: UsageRecord, incoming: int, skip: str | None = None) -> bool:
        """Evict until ``incoming`` more bytes fit in the shared total (both locks held): this
        process's least recently used pages first; when they run out, every page under the root
        by mtime (a recount); never ``skip``. False if it cannot fit."""
        recounted = self._known_total(usage, skip)
        assert usage.total is not None
        while usage.total + incoming > self.capacity_bytes:
            victim = self._index.evict()
            if victim is None:
                if recounted:
                    return False
                self._recount(usage, skip)  # pages other processes wrote
                recounted = True
                continue
            freed = self._unlink_page(victim.key, "evict")
            if freed is not None:
                usage.total = max(0, usage.total - freed)
                self.stats.evictions += 1
                self.stats.evicted_bytes += freed
        return True

    def _remove_foreign_dir(self, path: str) -> None:
        """Remove a directory standing where a page file belongs (links are not followed)."""
        logger.warning("disk backend %r: removing directory %s in place of a page", self.name, path)
        shutil.rmtree(path)

    # -- put -------------------------------------------------------------------------------

    def _write_temp(self, job: tuple[str, memoryview]) -> str | OSError:
        """Write one page to a fresh temp file beside its final name (no lock held)."""
        key, view = job
        directory = self._paths(key)[0]
        digest = key.split("-", 1)[1]
        name = f".{digest}.{os.getpid()}.{secrets.token_hex(6)}{TMP_SUFFIX}"
        tmp = os.path.join(directory, name)
        try:
            fd = create_temp(self._root, key, name)
            try:
                while view:
                    view = view[os.write(fd, view) :]
                touch(fd)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            unlink_quietly(tmp)
            self._note_error("put", tmp, exc)
            return exc
        return tmp

    def _commit(self, key: str, tmp: str, size: int, usage: UsageRecord) -> bool:
        """Evict for room, then rename the temp file onto the page (both locks held)."""
        indexed = self._index.remove(key)
        final = self._paths(key)[1]
        old = self._page_size(key)  # the page replaced: its bytes leave the total
        if not self._make_room(usage, size - old, skip=key):
            unlink_quietly(tmp)
            return False
        assert usage.total is not None
        try:
            try:
                os.replace(tmp, final)
            except IsADirectoryError:  # something made a directory of the page: not ours to keep
                self._remove_foreign_dir(final)
                os.replace(tmp, final)
        except OSError as exc:
            # keep index and files in step: the key is no longer indexed, so no old page
            unlink_quietly(tmp)
            if indexed is not None:
                freed = self._unlink_page(key, "put")
                usage.total -= freed or 0
            self._note_error("put", final, exc)
            return False
        usage.total += size - old
        usage.pending -= size
        self._index.insert(key, size, None)
        self.stats.puts += 1
        self.stats.put_bytes += size
        return True

    def _put_batch(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store pages: data written in parallel, renames in input order under the lock."""
        self._check_root()
        views = [memoryview(buf).cast("B") for _, buf in items]
        todo = [i for i, view in enumerate(views) if view.nbytes <= self.capacity_bytes]
        temps = self._pool.map(self._write_temp, [(items[i][0], views[i]) for i in todo])
        written = [(i, tmp) for i, tmp in zip(todo, temps, strict=True) if isinstance(tmp, str)]
        results = [False] * len(items)
        try:
            self._check_open()
            self._fail_if_medium_gone(temps, os.W_OK | os.X_OK)
            if written:
                self._commit_batch(items, views, written, results)
        except (BackendClosedError, BackendUnavailableError):
            unlink_quietly(*[tmp for i, tmp in written if not results[i]])
            raise
        with self._lock:
            self.stats.put_refused += results.count(False)
        if self._fsync:
            self._fsync_dirs({self._paths(items[i][0])[0] for i in todo if results[i]})
        return results

    def _commit_batch(
        self,
        items: Sequence[tuple[str, Buffer]],
        views: Sequence[memoryview],
        written: Sequence[tuple[int, str]],
        results: list[bool],
    ) -> None:
        """Rename the written temp files into place, in input order, under the usage lock
        (taken once for the batch) and ``_lock``; results[i] is set for each one stored."""
        try:
            with locked_usage(self._root) as usage, self._lock:
                self._check_open()
                self._known_total(usage)
                assert usage.total is not None
                # raised first by the whole batch: a crash before its last rename leaves the
                # record too high, never too low
                usage.pending = sum(views[i].nbytes for i, _ in written)
                usage.write(usage.total)
                for i, tmp in written:
                    results[i] = self._commit(items[i][0], tmp, views[i].nbytes, usage)
                usage.pending = 0
                usage.write(usage.total)
        except UnsafeUsageFileError as exc:
            raise BackendUnavailableError(f"disk backend {self.name!r}: {exc}") from exc
        except OSError as exc:  # the record could not be opened or written
            unlink_quietly(*[tmp for i, tmp in written if not results[i]])
            self._note_error("put", os.path.join(self._root, ".usage"), exc)
            self._fail_if_medium_gone([exc], os.W_OK | os.X_OK)

    def _fsync_dirs(self, directories: set[str]) -> None:
        """Make the renames durable: fsync each directory a page was renamed into, once."""
        for directory in sorted(directories):
            try:
                fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                self._note_error("put", directory, exc)

    # -- get -------------------------------------------------------------------------------

    def _read(
        self, job: tuple[str, memoryview | int | None], cached_only: bool = False
    ) -> bytes | int | OSError | None:
        """Read one page: its bytes, or (given a buffer) the length read into it, or (given a
        length) its first bytes, without a stamp; None: miss. ``cached_only`` (given a buffer):
        raise ``NotCachedError`` rather than wait for the medium."""
        key, buf = job
        try:
            fd = self._dirs.open_page(key)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._note_error("get", self._paths(key)[1], exc)
            return exc
        try:
            st = os.fstat(fd)
            problem = page_problem(st, self.capacity_bytes)
            if problem is not None:  # never read: a miss, counted as an error
                raise PermissionError(errno.EACCES, f"untrusted page file ({problem})")
            size = st.st_size
            got: bytes | int | None = None
            if isinstance(buf, int):
                return os.pread(fd, min(buf, size), 0)
            if buf is None:
                got = read_exact(fd, size)
            elif size <= buf.nbytes:
                view = [buf[:size]]
                got = size if self._reads.read(fd, view, 0, cached_only=cached_only) == size else None
            return got
        except OSError as exc:
            self._note_error("get", self._paths(key)[1], exc)
            return exc
        finally:
            os.close(fd)

    def _read_batch(
        self, keys: Sequence[str], buffers: Sequence[memoryview | None]
    ) -> list[bytes | int | None]:
        """Read pages, count them, refresh hits' recency, forget pages deleted elsewhere. Into
        buffers of less than ``_PARALLEL_BYTES`` in all, pages in the page cache are read on this
        thread until one is not (a pool round trip costs more than a read of cached bytes); the
        rest, and every page of a larger load of pages of ``_PARALLEL_PAGE_BYTES`` or more, in
        the pool (several threads copy cached pages faster than one, and keep several reads of
        the medium in flight)."""
        self._check_root()
        jobs = list(zip(keys, buffers, strict=True))
        into = bool(buffers) and isinstance(buffers[0], memoryview)
        total = sum(buf.nbytes for buf in buffers if isinstance(buf, memoryview))
        small = total < max(_PARALLEL_BYTES, _PARALLEL_PAGE_BYTES * len(buffers))
        if into and not small:
            outcomes = self._pool.map_parts(self._read, jobs)
        else:
            cached = read_while_cached(jobs, lambda j: self._read(j, True)) if into else []
            outcomes = cached + self._pool.map(self._read, jobs[len(cached) :])
        with self._lock:
            self.stats.gets += len(keys)
            for key, got in zip(keys, outcomes, strict=True):
                if isinstance(got, bytes | int):
                    self.stats.hits += 1
                    self.stats.get_bytes += got if isinstance(got, int) else len(got)
                    self._index.touch(key)
            self._forget_missing([k for k, got in zip(keys, outcomes, strict=True) if got is None])
            hits = [k for k, got in zip(keys, outcomes, strict=True) if isinstance(got, bytes | int)]
            if self._touch_on_read and hits and isinstance(buffers[0], memoryview | None):
                self._stamper.later(hits)
        self._fail_if_medium_gone(outcomes, os.R_OK | os.X_OK)
        return [None if isinstance(got, OSError) else got for got in outcomes]

    def _get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        found = self._read_batch(keys, [None] * len(keys))
        return [got if isinstance(got, bytes) else None for got in found]

    def _get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        """Read pages straight into ``buffers`` (readinto); a page too large is a miss."""
        found = self._read_batch(keys, [memoryview(buf).cast("B") for buf in buffers])
        return [got if isinstance(got, int) else None for got in found]

    def _get_prefix(self, keys: Sequence[str], nbytes: int, sizes: Sequence[int]) -> list[bytes | None]:
        """The first ``nbytes`` of each page (``pread``: only those bytes are read), or None for
        a miss; opened like a get (no link followed, untrusted files are misses); no recency
        refresh, not counted as gets; ``sizes`` are not needed."""
        self._check_root()
        outcomes = self._pool.map(self._read, [(key, nbytes) for key in keys])
        self._fail_if_medium_gone(outcomes, os.R_OK | os.X_OK)
        return [got if isinstance(got, bytes) else None for got in outcomes]

    # -- the rest --------------------------------------------------------------------------

    def _contains_batch(self, keys: Sequence[str]) -> list[bool]:
        """Stat each page file (sees other processes' pages); no recency refresh.

        Synchronous: a stat is cheaper than a thread-pool round trip on a local disk.
        """
        found = [self._exists(key) for key in keys]
        self._forget_missing([k for k, f in zip(keys, found, strict=True) if not f])
        return found

    def _describe_batch(self, hints: Sequence[tuple[str, Retention]]) -> None:
        with self._lock:
            self._retention.describe_batch(hints)

    def _touch_batch(self, keys: Sequence[str]) -> None:
        """Stamp each page file's mtime, in order (its LRU position, also after a restart).

        Synchronous: one ``utime`` per page, no read; a page missing or not a regular file is
        skipped (links are not followed).
        """
        for key in keys:
            stamp = next_stamp()
            with contextlib.suppress(OSError):
                os.utime(self._paths(key)[1], ns=(stamp, stamp), follow_symlinks=False)
                with self._lock:
                    self._index.touch(key)

    def _delete_batch(self, keys: Sequence[str]) -> int:
        """Delete page files (and their bytes from the shared total); returns how many."""
        try:
            with locked_usage(self._root) as usage, self._lock:
                self._check_open()
                return self._delete(keys, usage)
        except UnsafeUsageFileError as exc:
            raise BackendUnavailableError(f"disk backend {self.name!r}: {exc}") from exc
        except FileNotFoundError:  # the root is gone, and its pages with it
            with self._lock:
                self._check_open()
                for key in keys:
                    self._index.remove(key)
            return 0
        except OSError as exc:  # the record could not be opened or written
            self._note_error("delete", os.path.join(self._root, ".usage"), exc)
            self._fail_if_medium_gone([exc], os.W_OK | os.X_OK)
            return 0

    def _delete(self, keys: Sequence[str], usage: UsageRecord) -> int:
        self._known_total(usage)
        assert usage.total is not None
        deleted = 0
        for key in keys:
            self._index.remove(key)
            freed = self._unlink_page(key, "delete")
            if freed is not None:
                deleted += 1
                usage.total = max(0, usage.total - freed)
        usage.write(usage.total)
        return deleted

    def _used_bytes(self) -> int:
        with self._lock:
            return self._index.used

    def _state_bytes(self) -> int | None:
        with self._lock:
            return self._index.used_by_kind().get("state", 0)

    def _scan(self, prefix: str) -> Iterator[PageInfo]:
        """Every page file under ``path`` whose key starts with ``prefix``, also those other
        processes wrote; ``mtime`` is the file's (last put or get). Temp files are skipped."""
        if not os.path.isdir(self._root):
            raise BackendUnavailableError(f"disk backend {self.name!r}: {self._root!r} is gone")
        try:
            for key, st in self._walk(prefix):
                yield PageInfo(key, st.st_size, st.st_mtime)
        except OSError as exc:
            raise BackendUnavailableError(f"disk backend {self.name!r}: scan failed: {exc}") from exc

    def _close(self) -> None:
        """Stop the I/O pool (waits for in-flight page I/O); pages stay on disk."""
        with self._lock:
            self._index.clear()
        self._pool.close()
        self._stamper.close()
        self._dirs.close()
