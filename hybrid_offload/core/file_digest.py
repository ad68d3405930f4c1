"""Full-content digests of large files (model weights), computed once per file version.

:func:`file_sha256` reads the whole file and caches the sha256 under the file's *stamp*
``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``. A write, a rename onto it, ``touch``
or a ``chmod`` changes the ctime, which a user cannot set back, so a cached digest is never
reused for other bytes; a copy is a new inode and is hashed once.

That holds where the kernel sets the times. On file systems made from an image (squashfs/SIF,
erofs, iso9660, any file system on a loop device, FUSE) inode numbers and all times come from
the image, and two images of equal sizes with normalized times give equal stamps for different
bytes: there the digest is never cached, the file is hashed in full at every start
(:func:`image_file_system`, read from ``/proc/self/mountinfo``; where it cannot be read, the same).

The cache is one small file per stamp in ``<cache home>/file-digests`` (:func:`cache_home`).
It is used only where that directory is owned by this user and not group/other-writable, and
an entry only where it is a regular file owned by this user: a digest someone else wrote would
let two sets of weights share an identity. Otherwise the digest is computed every time.
Concurrent processes (an engine's scheduler and its workers) take a lock per stamp, so one
reads the file and the others wait for its entry.

Reading releases the GIL (``readinto`` and sha256 of large buffers), so
:func:`file_sha256_many` hashes several files in parallel threads.

Pure: no vLLM, no torch.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_ENV", "CHUNK_BYTES", "cache_home", "digest_dir", "file_sha256", "file_sha256_many",
    "file_stamp", "image_file_system",
]  # fmt: skip

#: overrides the cache home (default ``$XDG_CACHE_HOME/hybrid-offload``)
CACHE_ENV = "HYBRID_OFFLOAD_CACHE"
#: bytes read per call while hashing
CHUNK_BYTES = 8 << 20
_HEX = re.compile(r"[0-9a-f]{64}")
#: file system types whose inode numbers and times come from an image
IMAGE_FS_TYPES = frozenset({"squashfs", "erofs", "iso9660", "cramfs", "romfs", "udf", "zisofs"})
#: the block device major number of loop devices (a file system image mounted as a disk)
LOOP_MAJOR = 7
MOUNTINFO = Path("/proc/self/mountinfo")
_warned: set[str] = set()


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def image_file_system(st_dev: int, mountinfo: Path | None = None) -> str | None:
    """Why the file system of device ``st_dev`` takes its inode numbers and times from an image
    (e.g. ``"squashfs on /dev/loop3"``), or None where the kernel sets them. A device missing
    from ``mountinfo``, or ``mountinfo`` unreadable, counts as an image (nothing known)."""
    if os.major(st_dev) == LOOP_MAJOR:
        return f"a loop device ({os.major(st_dev)}:{os.minor(st_dev)})"
    wanted = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    mountinfo = MOUNTINFO if mountinfo is None else mountinfo
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError as exc:
        return f"{mountinfo} unreadable ({exc.strerror})"
    for line in lines:
        fields = line.split()
        if len(fields) < 7 or fields[2] != wanted or "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        fstype, source = fields[dash + 1], _unescape(fields[dash + 2]) if len(fields) > dash + 2 else ""
        if fstype in IMAGE_FS_TYPES or fstype.startswith("fuse") or source.startswith("/dev/loop"):
            return f"{fstype} on {source}"
        return None
    return f"device {wanted} not in {mountinfo}"


def cache_home() -> Path:
    """hybrid-offload's cache directory: ``$HYBRID_OFFLOAD_CACHE``, else
    ``$XDG_CACHE_HOME/hybrid-offload``, else ``~/.cache/hybrid-offload``."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "hybrid-offload"


def digest_dir() -> Path:
    return cache_home() / "file-digests"


def file_stamp(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """A file version's stamp: ``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``. Any
    write, rename onto the path, ``touch`` or ``chmod`` changes it (the ctime, which a user
    cannot set back), where the kernel sets the times (see the module docstring for images)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _stamp_name(st: os.stat_result) -> str:
    raw = ":".join(map(str, file_stamp(st)))
    return hashlib.sha256(raw.encode()).hexdigest()[:40]


def _same_version(a: os.stat_result, b: os.stat_result) -> bool:
    return _stamp_name(a) == _stamp_name(b)


def _usable_dir(directory: Path) -> bool:
    """Create ``directory`` (0700) if absent; True where it is ours and only we can write it."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(directory)
    except OSError as exc:
        logger.debug("file digests are not cached: %s: %s", directory, exc.strerror)
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        logger.warning(
            "hybrid-offload does not use the digest cache %s: it is not a directory owned by this "
            "user and writable only by it; weight files are hashed in full at every start", directory,
        )
        return False
    return True


def _read_entry(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != 64:
            return None
        text = os.read(fd, 64).decode("ascii", "replace")
    finally:
        os.close(fd)
    return text if _HEX.fullmatch(text) else None


def _write_entry(path: Path, digest: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(digest)
        os.replace(tmp, path)
    except OSError as exc:
        logger.debug("file digest not cached: %s: %s", path, exc.strerror)
        tmp.unlink(missing_ok=True)


def _hash(path: Path) -> tuple[str, os.stat_result]:
    """sha256 of the whole file and its stamp; OSError(EAGAIN) when it changed while read."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        before = os.fstat(f.fileno())
        while n := f.readinto(buf):
            h.update(view[:n])
        after = os.fstat(f.fileno())
    if not _same_version(before, after):
        raise OSError(errno.EAGAIN, "the file changed while it was read", str(path))
    return h.hexdigest(), after


def file_sha256(path: str | os.PathLike[str], *, cache: Path | None = None) -> str:
    """The sha256 (hex) of ``path``'s whole content, from the digest cache where this version of
    the file was hashed before. ``cache``: the digest directory (default :func:`digest_dir`).
    Raises OSError when the file cannot be read or keeps changing while it is read."""
    path = Path(path)
    st = os.stat(path)
    directory = digest_dir() if cache is None else cache
    image = image_file_system(st.st_dev)
    if image is not None:
        if image not in _warned:
            _warned.add(image)
            logger.info(
                "hybrid-offload hashes weight files on %s in full at every start: there inode "
                "numbers and times come from the image, so its digests are not cached", image
            )
        return _hash(path)[0]
    if not _usable_dir(directory):
        return _hash(path)[0]
    entry = directory / f"{_stamp_name(st)}.sha256"
    if (found := _read_entry(entry)) is not None:
        return found
    try:
        lock_fd = os.open(directory / f"{entry.stem}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        lock_fd = -1
    try:
        if lock_fd >= 0:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            if (found := _read_entry(entry)) is not None:
                return found
        digest, hashed = _hash(path)
        if _same_version(st, hashed):
            _write_entry(entry, digest)
        return digest
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)
            (directory / f"{entry.stem}.lock").unlink(missing_ok=True)


def file_sha256_many(
    paths: Sequence[Path], *, cache: Path | None = None, threads: int | None = None
) -> list[str]:
    """:func:`file_sha256` of each path (in order), up to ``threads`` (default: CPUs, at most 8)
    at a time. Raises the first OSError."""
    if len(paths) <= 1:
        return [file_sha256(p, cache=cache) for p in paths]
    workers = threads or min(8, os.cpu_count() or 1, len(paths))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hybrid-offload-digest") as pool:
        return list(pool.map(lambda p: file_sha256(p, cache=cache), paths))
