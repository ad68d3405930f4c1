"""The disk backend's page files: reached below the root without following links, read, stamped.

* **Reaching a file.** Each component below the root is opened relative to its parent with
  ``O_NOFOLLOW`` (:func:`.root.open_dir_below`): a symbolic link anywhere below the root
  fails the open (``OSError``) instead of leading out of it. Page files are opened with
  ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO in place of a page must not block the open).
* **Stamps.** A page's mtime is its LRU position (also after a restart): :func:`touch` stamps a
  wall-clock time in ns, strictly increasing within the process (file clocks are coarse).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .root import open_dir_below, page_problem

__all__ = [
    "OPEN_FLAGS",
    "NotCachedError",
    "PageDirs",
    "after",
    "counted_size",
    "create_temp",
    "next_stamp",
    "open_page",
    "preadv_at",
    "read_exact",
    "read_while_cached",
    "readinto_exact",
    "readv_full",
    "stat_page",
    "touch",
    "unlink_page",
    "unlink_quietly",
]

OPEN_FLAGS = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
_T = TypeVar("_T")
_R = TypeVar("_R")
_ANY_SIZE = 1 << 62

_stamp_lock = threading.Lock()
_last_stamp = 0


def next_stamp() -> int:
    """Wall-clock ns, strictly increasing within this process (file clocks are coarse)."""
    global _last_stamp
    with _stamp_lock:
        _last_stamp = max(time.time_ns(), _last_stamp + 1)
        return _last_stamp


def touch(fd: int) -> None:
    """Stamp the file's mtime, its LRU position after a restart (best effort)."""
    stamp = next_stamp()
    with contextlib.suppress(OSError):
        os.utime(fd, ns=(stamp, stamp))


def read_exact(fd: int, size: int) -> bytes | None:
    """Read ``size`` bytes; None if the file ends early."""
    parts: list[bytes] = []
    got = 0
    while got < size:
        chunk = os.read(fd, size - got)
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class NotCachedError(Exception):
    """Some of a page's bytes are not in the page cache: reading them would wait for the medium."""


#: preadv2 flag: fail with EAGAIN instead of waiting for the medium (Linux; None elsewhere)
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)


def preadv_at(fd: int, views: list[memoryview], offset: int, *, cached_only: bool = False) -> int:
    """One ``preadv`` of ``views`` at ``offset``; the bytes read (0 at the file's end).
    ``cached_only``: raise :class:`NotCachedError` instead of waiting for the medium (also
    where the OS or file system cannot tell)."""
    if not cached_only:
        return os.preadv(fd, views, offset)
    if _NOWAIT is None:
        raise NotCachedError
    try:
        return os.preadv(fd, views, offset, _NOWAIT)
    except (BlockingIOError, OSError) as exc:
        raise NotCachedError from exc  # EAGAIN: not cached; EOPNOTSUPP: cannot tell


def after(views: Sequence[memoryview], done: int, limit: int = 1024) -> list[memoryview]:
    """What is left of ``views`` (read or written back to back) once ``done`` bytes moved; at
    most ``limit`` of them (IOV_MAX)."""
    rest: list[memoryview] = []
    for view in views:
        if done >= view.nbytes:
            done -= view.nbytes
            continue
        rest.append(view[done:] if done else view)
        done = 0
        if len(rest) == limit:
            break
    return rest


def readv_full(fd: int, views: Sequence[memoryview], offset: int, *, cached_only: bool = False) -> int:
    """Read ``views`` back to back from ``offset`` until full or the file ends (no intermediate
    copy); the bytes read. ``cached_only`` as in :func:`preadv_at`."""
    got, total = 0, sum(v.nbytes for v in views)
    while got < total:
        n = preadv_at(fd, after(views, got), offset + got, cached_only=cached_only)
        if n == 0:
            break
        got += n
    return got


def readinto_exact(fd: int, view: memoryview, *, offset: int = 0, cached_only: bool = False) -> bool:
    """readinto ``view`` from ``offset`` (the file's start) until full; False if the file ends
    early. ``cached_only`` as in :func:`preadv_at`."""
    return readv_full(fd, [view], offset, cached_only=cached_only) == view.nbytes


def read_while_cached(jobs: list[_T], read: Callable[[_T], _R]) -> list[_R]:
    """``read(job)`` of the first jobs, in order, on this thread, up to the first that raises
    :class:`NotCachedError`: pages in the page cache are read faster here than through a thread
    pool round trip; the rest are the caller's (their results are not in the list)."""
    out = []
    for job in jobs:
        try:
            out.append(read(job))
        except NotCachedError:
            break
    return out


def unlink_quietly(*paths: str) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _page_dir(root: str, key: str, create: bool) -> tuple[int, str]:
    """(descriptor of the key's page directory, the page's file name); the caller closes it."""
    namespace, digest = key.split("-", 1)
    return open_dir_below(root, (namespace, digest[:2]), create=create), digest


def create_temp(root: str, key: str, name: str) -> int:
    """Create temp file ``name`` in the key's page directory (made if missing), reached from
    the root without following links; never re-creates the root."""
    dir_fd, _ = _page_dir(root, key, create=True)
    try:
        return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o600, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def open_page(root: str, key: str) -> int:
    """A read-only descriptor of the key's page file (no link followed; the caller checks
    ``fstat`` and closes it); ``FileNotFoundError`` if absent."""
    dir_fd, digest = _page_dir(root, key, create=False)
    try:
        return os.open(digest + ".page", os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def stat_page(root: str, key: str) -> os.stat_result:
    """``lstat`` of the key's page file (no link followed); ``FileNotFoundError`` if absent."""
    dir_fd, digest = _page_dir(root, key, create=False)
    try:
        return os.stat(digest + ".page", dir_fd=dir_fd, follow_symlinks=False)
    finally:
        os.close(dir_fd)


def unlink_page(root: str, key: str) -> os.stat_result | None:
    """Remove the key's page file if this uid owns it (no link followed): its ``lstat``, or None
    if absent or another owner's (left alone); ``OSError`` otherwise."""
    try:
        dir_fd, digest = _page_dir(root, key, create=False)
    except FileNotFoundError:
        return None
    try:
        st = os.stat(digest + ".page", dir_fd=dir_fd, follow_symlinks=False)
        if st.st_uid != os.geteuid():
            return None
        os.unlink(digest + ".page", dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    finally:
        os.close(dir_fd)
    return st


def counted_size(st: os.stat_result) -> int:
    """Bytes a page file (its ``lstat``) counts in the shared total: 0 unless it is a page this
    process trusts (a regular file of its uid, not writable by group or others)."""
    return st.st_size if page_problem(st, _ANY_SIZE) is None else 0


class PageDirs:
    """Descriptors of page directories (``root/<namespace>/<2 hex>``) kept open for reads, so a
    page read or stat opens one file instead of walking three directories (a syscall each,
    and on a busy engine each one waits for the GIL).

    Read-only: never used to create files (a page written into a directory removed meanwhile
    would be lost). A directory removed and made again since it was opened (``cache clear``)
    makes the open fail with ``FileNotFoundError``; if the kept directory is unlinked (a page
    merely absent leaves it linked: one ``fstat``), it is walked afresh once. Replaced
    descriptors stay open until :meth:`close` (another thread may still be using one: closing
    it could hand its number to an unrelated file). At most ``limit`` directories are kept;
    beyond that, reads walk. Thread-safe.
    """

    def __init__(self, root: str, limit: int = 4096) -> None:
        self._root = root
        self._limit = limit
        self._lock = threading.Lock()
        self._fds: dict[tuple[str, str], int] = {}
        self._retired: list[int] = []

    def _dir(self, part: tuple[str, str], stale: int | None) -> tuple[int, bool]:
        """(descriptor of ``part``, whether the caller must close it)."""
        with self._lock:
            fd = self._fds.get(part)
            if fd is not None and fd != stale:
                return fd, False
        fresh = open_dir_below(self._root, part, create=False)
        with self._lock:
            if stale is not None and self._fds.get(part) == stale:
                self._retired.append(self._fds.pop(part))
            if part in self._fds or len(self._fds) >= self._limit:
                return fresh, True
            self._fds[part] = fresh
            return fresh, False

    def _at(self, key: str, call: Callable[[str, int], _T]) -> _T:
        namespace, digest = key.split("-", 1)
        part, name, stale = (namespace, digest[:2]), digest + ".page", None
        for attempt in (0, 1):
            fd, owned = self._dir(part, stale)
            try:
                return call(name, fd)
            except FileNotFoundError:
                if attempt or owned or os.fstat(fd).st_nlink > 0:
                    raise
                stale = fd  # the directory was removed since: walk afresh once
            finally:
                if owned:
                    os.close(fd)
        raise AssertionError("unreachable")

    def open_page(self, key: str) -> int:
        """As :func:`open_page`."""
        flags = os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS
        return self._at(key, lambda name, fd: os.open(name, flags, dir_fd=fd))

    def stat_page(self, key: str) -> os.stat_result:
        """As :func:`stat_page`."""
        return self._at(key, lambda name, fd: os.stat(name, dir_fd=fd, follow_symlinks=False))

    def stamp_page(self, key: str, ns: int) -> None:
        """Set the page file's atime and mtime to ``ns`` (no link followed)."""
        self._at(key, lambda name, fd: os.utime(name, ns=(ns, ns), dir_fd=fd, follow_symlinks=False))

    def close(self) -> None:
        """Close every descriptor (call when no read is in flight any more)."""
        with self._lock:
            fds, self._fds, retired, self._retired = list(self._fds.values()), {}, self._retired, []
        for fd in fds + retired:
            with contextlib.suppress(OSError):
                os.close(fd)


class PageStamper:
    """Stamps read pages' mtimes (their LRU position for other processes and after a restart)
    on its own thread, in the order given, through :class:`PageDirs`: off the reader's path,
    where a ``utime`` per page costs about as much as reading the page. Best effort (a page
    gone meanwhile is skipped). :meth:`close` waits for the stamps queued; later ones are
    dropped. Thread-safe."""

    def __init__(self, dirs: PageDirs, name: str) -> None:
        self._dirs, self._name = dirs, name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def later(self, keys: list[str]) -> None:
        with self._lock:
            if self._closed:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, f"disk-stamp-{self._name}")
            self._pool.submit(self._stamp, keys)

    def _stamp(self, keys: list[str]) -> None:
        for key in keys:
            with contextlib.suppress(OSError):
                self._dirs.stamp_page(key, next_stamp())

    def close(self) -> None:
        with self._lock:
            self._closed, pool, self._pool = True, self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
