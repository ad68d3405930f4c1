"""O_DIRECT reads for the disk backend (both layouts), where they apply; buffered reads otherwise.

A read goes around the page cache (``O_DIRECT``, DMA from the medium straight into the caller's
buffer) only when all of this holds, else it is an ordinary buffered ``preadv``:

* **Aligned.** Its file offset, every destination's address and every destination's length
  are multiples of what the file system asks (``statx``'s ``STATX_DIOALIGN``: the logical
  block size, e.g. 512 or 4096 bytes; :data:`ALIGN`, 4 KiB, where the kernel cannot tell; a
  file system that says it takes no ``O_DIRECT`` turns it off). Nothing is bounced: reading
  an aligned superset into an aligned buffer and copying out was at most 6-18 % faster cold
  than a buffered read here, level or slower at other piece sizes, costs a copy and memory,
  and would leave every read's pages out of the page cache (benchmarks/disk.md, "Disk reads
  against the raw ceiling"). The engine's staging rows (64-byte aligned, pages of a 64-byte
  multiple) are not aligned: their reads are buffered.
* **Not in the page cache.** ``cachestat`` (Linux 6.5+) says at most 1/8 of the range's pages
  are cached: pages in the page cache are read from it, which an ``O_DIRECT`` read never does.
  Where ``cachestat`` is missing, reads are buffered. ``cachestat`` has no side effect (an
  ``RWF_NOWAIT`` probe would start readahead of what is then read around the cache).
* **The file system takes it.** The file is opened again with ``O_DIRECT`` through
  ``/proc/self/fd`` (the same inode, also if it was renamed over or unlinked since). A file
  system that refuses (``EINVAL`` at the open or at a read; tmpfs before Linux 6.6, some FUSE
  and network file systems), or no ``/proc``, turns ``O_DIRECT`` off for this backend, logged
  once, not counted as an error; the read goes on buffered from where it stopped.

What a reader sees is unchanged: Linux writes dirty page-cache pages of the range back before
an ``O_DIRECT`` read (so bytes written and not yet on the medium are read, as a buffered read
would), the bytes on the medium after a crash are the same whichever way they are read, and
both layouts make a page visible only once all its bytes are written (temp file renamed into
place; segment bytes before the record pointing at them). ``O_DIRECT`` reads do not fill the
page cache: a page read that way is read from the medium again next time.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .files import NotCachedError, after, readv_full

__all__ = ["ALIGN", "DirectReads", "address", "cached_pages", "dio_alignment", "read_parts"]

logger = logging.getLogger("hybrid_offload.backends.disk")

#: O_DIRECT alignment of file offsets, lengths and buffer addresses where ``statx`` cannot tell
ALIGN = 4096
_MIN_ALIGN = 512  # no file system asks less (a cheap first test)
_STATX_DIOALIGN = 0x2000
_AT_EMPTY_PATH = 0x1000
_PAGE = 4096  # cachestat counts pages of this size (x86-64, and arm64 with 4 KiB pages)
#: direct only where at most this fraction of the range's pages is in the page cache
_CACHED_MAX = 1 / 8
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


def _syscall() -> tuple[Callable[..., Any], int] | None:
    """libc's ``syscall`` and cachestat's number (451, the same on x86-64 and arm64)."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        return None
    if os.sysconf("SC_PAGE_SIZE") != _PAGE:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn, 451


_CACHESTAT = _syscall()


def _libc_statx() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_STATX = _libc_statx()


def dio_alignment(fd: int) -> int | None:
    """The alignment ``O_DIRECT`` reads of ``fd`` need of file offsets, lengths and buffer
    addresses (``statx``'s ``STATX_DIOALIGN``, Linux 6.1+: the larger of its offset and memory
    alignments); 0 where the file takes no ``O_DIRECT``; None where the kernel cannot tell."""
    if _STATX is None:
        return None
    buf = ctypes.create_string_buffer(256)
    if _STATX(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf) != 0:
        return None
    if not int.from_bytes(buf.raw[0:4], "little") & _STATX_DIOALIGN:
        return None  # this file system does not say
    memory, offset = int.from_bytes(buf.raw[152:156], "little"), int.from_bytes(buf.raw[156:160], "little")
    return max(memory, offset) if memory and offset else 0


def read_parts(io_threads: int) -> int:
    """How many parts a large load is cut into, read at the same time: ``io_threads``, but no
    more than the CPUs this process may run on (at least 2). Copying cached pages is CPU work:
    on 2 cores, 4 parts read 128 KiB pages slower than 2 (8.3 vs 9.7 GB/s), and cold reads were
    no faster (benchmarks/disk.md, "Disk reads against the raw ceiling")."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(io_threads, max(2, cpus)))


def cached_pages(fd: int, offset: int, length: int) -> tuple[int, int] | None:
    """(pages of ``fd``'s range in the page cache, pages in the range), or None where the kernel
    cannot tell (no ``cachestat``)."""
    if _CACHESTAT is None or length <= 0:
        return None
    fn, number = _CACHESTAT
    span, stat = _Range(offset, length), _CacheStat()
    if fn(number, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        return None  # ENOSYS (an older kernel), EOPNOTSUPP, ...
    first, last = offset // _PAGE, (offset + length - 1) // _PAGE
    return int(stat.nr_cache), last - first + 1


def address(view: memoryview) -> int | None:
    """The address of a writable, contiguous, non-empty buffer; None for any other."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


def _aligned(offset: int, views: Sequence[memoryview], align: int) -> bool:
    if offset % align or not views or any(v.nbytes % align for v in views):
        return False
    for view in views:
        at = address(view)
        if at is None or at % align:
            return False
    return True


class DirectReads:
    """One backend's reads of file ranges into buffers: ``O_DIRECT`` where it applies (module
    docstring), buffered otherwise. Thread-safe; holds no descriptor between calls."""

    def __init__(self, name: str) -> None:
        self._name = name
        #: False once the file system refused O_DIRECT (or this OS lacks it or cachestat)
        self.enabled = bool(_O_DIRECT) and _CACHESTAT is not None
        self.direct_bytes = 0  # bytes read around the page cache (for tests and benchmarks)
        self._lock = threading.Lock()
        self._align: int | None = None  # learnt from the first file asked (one file system)

    def _alignment(self, fd: int) -> int:
        """The O_DIRECT alignment of this backend's files (0: none taken; see
        :func:`dio_alignment`, :data:`ALIGN` where the kernel cannot tell)."""
        if self._align is None:
            align = dio_alignment(fd)
            self._align = ALIGN if align is None else align
            if not align and align is not None:
                self._refused(OSError(errno.EINVAL, "statx: no O_DIRECT alignment"))
        return self._align

    def read(self, fd: int, views: Sequence[memoryview], offset: int, *, cached_only: bool = False) -> int:
        """Read ``views`` back to back from ``offset`` of ``fd`` until full or the file ends;
        the bytes read. ``OSError`` as a buffered read raises it (a refused ``O_DIRECT`` is not
        one: the read goes on buffered). ``cached_only``: raise :class:`.NotCachedError` rather
        than wait for the medium (for an aligned read, asked of ``cachestat`` first: an
        ``RWF_NOWAIT`` read would start readahead into the page cache of what the direct read
        then reads around it)."""
        counts = None
        if self.enabled and not offset % _MIN_ALIGN:
            align = self._alignment(fd)
            if align and _aligned(offset, views, align):
                counts = cached_pages(fd, offset, sum(v.nbytes for v in views))
        if cached_only:
            if counts is None:
                return readv_full(fd, views, offset, cached_only=True)
            if counts[0] < counts[1]:
                raise NotCachedError
            return readv_full(fd, views, offset)
        got, finished = 0, False
        if counts is not None and counts[0] <= counts[1] * _CACHED_MAX:
            got, finished = self._direct(fd, views, offset)
        if finished:
            return got
        return got + readv_full(fd, after(views, got, len(views)) if got else views, offset + got)

    def _direct(self, fd: int, views: Sequence[memoryview], offset: int) -> tuple[int, bool]:
        """(bytes read with O_DIRECT, whether the read is over: full, or the file ended)."""
        try:
            dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | _O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOENT):  # refused; no /proc
                self._refused(exc)
            return 0, False  # buffered
        try:
            total, got = sum(v.nbytes for v in views), 0
            while got < total:
                try:
                    n = os.preadv(dfd, after(views, got), offset + got)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._refused(exc)
                    return got, False
                if n == 0:
                    break  # the file's end
                got += n
                with self._lock:
                    self.direct_bytes += n
                if got < total and got % _MIN_ALIGN:
                    break  # stopped inside a block: the file's end
            return got, True
        finally:
            os.close(dfd)

    def _refused(self, exc: OSError) -> None:
        if self.enabled:
            self.enabled = False
            logger.info(
                "disk backend %r: the file system refuses O_DIRECT reads, or there is no /proc "
                "(%s): reading through the page cache only",
                self._name,
                exc,
            )
