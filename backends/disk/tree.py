"""The disk backend's directory tree: where a page lives and how the tree is walked.

* **Layout.** Key ``<namespace>-<digest>`` lives at ``<root>/<namespace>/<digest[:2]>/
  <digest>.page``; a put's temp file ``.<digest>.<pid>.<random>.tmp`` lies beside it. Only
  ``<namespace>`` and ``<xx>`` directories of lower-case hex are entered; anything else under
  the root (the shared ``.usage`` record, foreign files, links) is not a page.
* **Walk.** One directory is listed at a time; a page file counts only if it is a regular file
  of this process's uid, not writable by group or others (links are never followed).
* **Stale temp files.** A temp file whose writer is dead, or one older than ten minutes, is
  garbage; a live writer's fresh one may still be renamed and is kept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterator

from ..base import KEY_PATTERN
from .root import page_problem

__all__ = [
    "PAGE_SUFFIX",
    "TMP_SUFFIX",
    "page_paths",
    "remove_stale_tmp",
    "scan_pages",
    "walk",
]

logger = logging.getLogger(__name__)

PAGE_SUFFIX = ".page"
TMP_SUFFIX = ".tmp"
STALE_TMP_NS = 600 * 10**9  # a temp file this old is garbage even if its pid is alive
ANY_SIZE = 1 << 62
_NAMESPACE_DIR = re.compile(r"[0-9a-f]{8,64}")
_FANOUT_DIR = re.compile(r"[0-9a-f]{2}")


def page_paths(root: str, key: str) -> tuple[str, str]:
    """(directory, page file) of a validated key."""
    namespace, digest = key.split("-", 1)
    directory = os.path.join(root, namespace, digest[:2])
    return directory, os.path.join(directory, digest + PAGE_SUFFIX)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def _subdirs(path: str, pattern: re.Pattern[str]) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return [e for e in it if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _fanout_dirs(root: str, prefix: str) -> Iterator[os.DirEntry[str]]:
    """The ``<namespace>/<xx>`` directories that can hold keys starting with ``prefix``."""
    namespace, dash, digest = prefix.partition("-")
    for ns_dir in _subdirs(root, _NAMESPACE_DIR):
        if ns_dir.name != namespace if dash else not ns_dir.name.startswith(namespace):
            continue
        for fan_dir in _subdirs(ns_dir.path, _FANOUT_DIR):
            if fan_dir.name.startswith(digest[:2]):
                yield fan_dir


def walk(
    root: str,
    prefix: str,
    on_tmp: Callable[[os.DirEntry[str]], None] | None = None,
    on_dir: Callable[[str], None] | None = None,
) -> Iterator[tuple[str, os.stat_result]]:
    """(key, stat) of every page file whose key starts with ``prefix``; temp files go to
    ``on_tmp`` and page directories to ``on_dir``; anything else in the tree (foreign files,
    links, directories) is skipped."""
    for fan_dir in _fanout_dirs(root, prefix):
        if on_dir is not None:
            on_dir(fan_dir.path)
        namespace = os.path.basename(os.path.dirname(fan_dir.path))
        try:
            with os.scandir(fan_dir.path) as it:
                entries = list(it)
        except FileNotFoundError:  # removed since it was listed
            continue
        for entry in entries:
            name = entry.name
            if name.startswith(".") and name.endswith(TMP_SUFFIX):
                if on_tmp is not None:
                    on_tmp(entry)
                continue
            key = f"{namespace}-{name.removesuffix(PAGE_SUFFIX)}"
            if (
                not name.endswith(PAGE_SUFFIX)
                or not name.startswith(fan_dir.name)
                or KEY_PATTERN.fullmatch(key) is None
                or not key.startswith(prefix)
            ):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat(follow_symlinks=False)
                if page_problem(st, ANY_SIZE) is None:  # not of another owner, not a link
                    yield key, st


def remove_stale_tmp(entry: os.DirEntry[str], now_ns: int, backend: str) -> None:
    """Remove a crashed writer's temp file; keep one a live writer may still rename."""
    parts = entry.name.split(".")  # ["", digest, pid, random, "tmp"]
    pid = int(parts[2]) if len(parts) == 5 and parts[2].isdigit() else 0
    with contextlib.suppress(FileNotFoundError):  # its writer renamed or removed it
        age_ns = now_ns - entry.stat(follow_symlinks=False).st_mtime_ns
        if pid > 0 and age_ns < STALE_TMP_NS and pid_alive(pid):
            return
        os.unlink(entry.path)
        logger.info("disk backend %r: removed unfinished write %s", backend, entry.path)


def scan_pages(
    walker: Callable[..., Iterator[tuple[str, os.stat_result]]], backend: str, clean: bool
) -> list[tuple[int, str, int]]:
    """(mtime_ns, key, size) of every page file, oldest first, from ``walker(prefix, on_tmp)``;
    with ``clean``, dead writers' temp files are removed on the way."""
    now = time.time_ns()
    on_tmp = (lambda entry: remove_stale_tmp(entry, now, backend)) if clean else None
    return sorted((st.st_mtime_ns, key, st.st_size) for key, st in walker("", on_tmp))
