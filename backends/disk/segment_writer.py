"""One writing process's files in the segment layout: its log and its active segment.

A writer appends page bytes to its segments (``<writer>-<n>.seg``, a new one past the size
limit) and records to its log (``<writer>.log``), holding an ``flock`` of the log while it
lives: a log whose lock is free belongs to a writer that is gone. Not thread-safe: the backend
(:mod:`.segments`) calls it under its locks.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
import sys
import time
from collections.abc import Callable

from .files import after
from .segment_log import Record, encode, log_name, segment_name

__all__ = ["SegmentWriter"]

_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FALLOC_FL_KEEP_SIZE = 1


def _libc_fallocate() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _libc_fallocate() if sys.platform.startswith("linux") else None


def _reserve(fd: int, nbytes: int) -> None:
    """Reserve a segment's blocks up front, its size unchanged (``FALLOC_FL_KEEP_SIZE``):
    appends into reserved blocks ran ~1.5x faster here (ext4). Best effort: no reservation
    where the call or the file system lacks it."""
    if _fallocate is not None:
        _fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, nbytes)


class SegmentWriter:
    """This process's log and active segment (used under the backend's locks)."""

    def __init__(self, dir_fd: int) -> None:
        """Create this writer's log, already locked when it appears under its name (created as
        ``<writer>.new``, locked, then renamed), so no other process can take it for a dead one."""
        self.id = secrets.randbits(63) | 1
        self.log = log_name(self.id)
        self._dir_fd = dir_fd
        temp = f"{self.id:016x}.new"
        self.log_fd = os.open(temp, _CREATE | os.O_APPEND, 0o600, dir_fd=dir_fd)
        try:
            fcntl.flock(self.log_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(temp, self.log, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            os.close(self.log_fd)
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            raise
        self.log_end = 0
        self.number = 0
        self.segment_fd = -1
        self.segment_end = 0
        self.sizes: dict[str, int] = {}  # segment files this writer owns -> bytes written
        self._last_ts = 0

    def ts(self, after: int) -> int:
        """A timestamp later than this writer's last one and than ``after``."""
        self._last_ts = max(time.time_ns(), self._last_ts + 1, after + 1)
        return self._last_ts

    def append_pages(self, views: list[memoryview], limit: int) -> list[tuple[int, int]]:
        """Write ``views`` contiguously into the active segment (a new one past ``limit``); the
        (segment number, offset) of each."""
        total = sum(v.nbytes for v in views)
        if self.segment_fd < 0 or (self.segment_end and self.segment_end + total > limit):
            self._new_segment(max(limit, total))
        offset = self.segment_end
        done = 0
        while done < total:  # pwritev may stop short
            done += os.pwritev(self.segment_fd, after(views, done), offset + done)
        self.segment_end += total
        self.sizes[segment_name(self.id, self.number)] = self.segment_end
        out, at = [], offset
        for v in views:
            out.append((self.number, at))
            at += v.nbytes
        return out

    def _new_segment(self, limit: int) -> None:
        if self.segment_fd >= 0:
            os.close(self.segment_fd)
        self.number += 1
        self.segment_fd = os.open(segment_name(self.id, self.number), _CREATE, 0o600, dir_fd=self._dir_fd)
        self.segment_end = 0
        _reserve(self.segment_fd, limit)

    @property
    def active(self) -> str:
        return segment_name(self.id, self.number)

    def append_records(self, records: list[Record], sync: bool) -> None:
        """Append ``records`` with one write. On ``OSError`` the log may end in a torn record, or
        hold records that readers already applied although the sync failed: nothing is taken
        back, and the caller stops writing to this log (:meth:`close`; the next writer adopts it)."""
        data = encode(records)
        written = os.write(self.log_fd, data)
        if written != len(data):
            raise OSError(errno.ENOSPC, "short write to the segment log")
        if sync:
            os.fdatasync(self.log_fd)
        self.log_end += len(data)

    def close(self) -> None:
        """Close the files (idempotent); releases the log's flock: the next writer adopts it."""
        for fd in (self.segment_fd, self.log_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.segment_fd = self.log_fd = -1
