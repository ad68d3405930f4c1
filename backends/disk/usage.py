"""The disk backend's shared usage record: one capacity for every process writing to a root.

* **Record.** ``<root>/.usage`` holds the total size of the page files under the root, as 20
  decimal digits and a newline. It is not a page: the tree walk only enters the root's hex
  directories.
* **Lock.** Every process holds ``flock(LOCK_EX)`` on the root directory around each rename
  of a page into place, each evicting or deleting unlink and each recount, and updates the
  total under it; page data is never read or written while it is held. The lock is taken on a
  fresh descriptor each time (so it also serializes threads of one process) and checked to be
  still the directory named ``path`` (a root removed and made again is opened again). A root
  that never held a page has no record (a missing record means: count the tree).
* **Crash safety.** Callers raise the total before renames (``pending``) and lower it only
  after unlinks, so a process dying in between leaves it too high (pages are evicted a little early), never
  too low (the bound would not hold). A missing, unreadable or negative record reads as
  ``None``: the caller recounts the tree; every start recounts anyway.
* **Trust.** Opened relative to the root with ``O_NOFOLLOW``; it must be a regular file of this
  process's uid, with one link, not writable by group or others, else
  :class:`UnsafeUsageFileError`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
from collections.abc import Iterator

from .root import open_dir_below, page_problem

__all__ = ["USAGE_NAME", "UnsafeUsageFileError", "UsageRecord", "locked_usage"]

USAGE_NAME = ".usage"
_RECORD = re.compile(rb"(\d{1,20})\n")
_RECORD_LEN = 21
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_UNSAFE_ERRNOS = {errno.ELOOP, errno.EISDIR, errno.ENXIO}
_ANY_SIZE = 1 << 62


class UnsafeUsageFileError(Exception):
    """``.usage`` is not a file this process may trust (a link, another owner's, ...)."""


class UsageRecord:
    """The record, read under the lock: ``total`` as read (None: recount), then as the caller
    keeps it; :meth:`write` stores it plus ``pending``, the bytes of pages about to be renamed
    into place (so the record is raised before they arrive)."""

    def __init__(self, root_fd: int, path: str) -> None:
        self._root_fd = root_fd
        self._fd: int | None = None
        self._size = 0
        self.path = path
        st = os.fstat(root_fd)
        self.root_id = (st.st_dev, st.st_ino)
        self.total: int | None = None
        self.pending = 0
        with contextlib.suppress(FileNotFoundError):
            self._open(create=False)
            assert self._fd is not None
            match = _RECORD.fullmatch(os.pread(self._fd, 64, 0))
            self.total = int(match.group(1)) if match else None

    @property
    def exists(self) -> bool:
        """Whether the record file exists (it is made by the first nonzero write)."""
        return self._fd is not None

    def _open(self, create: bool) -> None:
        flags = _OPEN_FLAGS | (os.O_CREAT if create else 0)
        try:
            fd = os.open(USAGE_NAME, flags, 0o600, dir_fd=self._root_fd)
        except OSError as exc:
            if exc.errno in _UNSAFE_ERRNOS:
                raise UnsafeUsageFileError(f"{self.path!r} is not a regular file ({exc.strerror})") from exc
            raise
        try:
            st = os.fstat(fd)
            problem = page_problem(st, _ANY_SIZE) or ("a hard link" if st.st_nlink > 1 else None)
            if problem is not None:
                raise UnsafeUsageFileError(f"{self.path!r} is {problem}")
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._size = fd, st.st_size

    def write(self, total: int) -> None:
        """Store ``total + pending`` (at least 0); a missing record stays missing while that is 0 (a
        missing record is recounted, which for an empty tree is cheap)."""
        total = max(0, total + self.pending)  # below 0 only after drift (pages added by hand)
        if self._fd is None:
            if total == 0:
                return
            self._open(create=True)
            assert self._fd is not None
        os.pwrite(self._fd, b"%020d\n" % total, 0)
        if self._size != _RECORD_LEN:
            os.ftruncate(self._fd, _RECORD_LEN)
            self._size = _RECORD_LEN

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _still_root(root: str, fd: int) -> bool:
    """Whether ``fd`` is still the directory named ``root`` (not removed and made again)."""
    try:
        named = os.lstat(root)
    except FileNotFoundError:
        return False
    st = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino)


@contextlib.contextmanager
def locked_usage(root: str) -> Iterator[UsageRecord]:
    """The root's usage record under an exclusive ``flock`` of the root directory; ``OSError``
    if the root cannot be reached, :class:`UnsafeUsageFileError` if the record is untrusted."""
    path = os.path.join(root, USAGE_NAME)
    for _ in range(8):
        root_fd = open_dir_below(root, (), create=False)
        try:
            fcntl.flock(root_fd, fcntl.LOCK_EX)
            if _still_root(root, root_fd):
                record = UsageRecord(root_fd, path)
                try:
                    yield record
                finally:
                    record.close()
                return
        finally:
            os.close(root_fd)  # releases the lock
    raise OSError(errno.ESTALE, f"{root!r} keeps being replaced")
