"""Expiry of the lmcache backend's remote values (option ``ttl_s``), so the remote store does not
grow across restarts.

The lmcache backend's index lives in its process: a new instance starts empty and never reads
what an earlier one stored, and LMCache's Redis connector can neither list nor delete. Without
an expiry every restart would leave its pages in the remote for good. With ``ttl_s``:

* **Redis** (``redis://``, ``rediss://``, ``unix://``): after each write (page or tombstone) and
  each hit, both values LMCache keeps per page (``<key>kv_bytes``, ``<key>metadata``) get
  ``PEXPIRE ttl_s`` in one pipeline of a small redis-py client of our own; the server drops
  them ``ttl_s`` after their last put or get.
* **File system** (``fs://``): hits refresh the file's mtime; at start-up, files of this
  ``namespace`` (names ``<namespace>-<hex>@1@0@1<hex>@uint8.data``, nothing else) untouched for
  longer than ``ttl_s`` are removed.
* Other remotes have no expiry here (LMCache gives no way to list or expire their values).

Failures of an expiry step are logged and counted by the caller, never raised as a miss: a
value left without expiry is one page of growth, not a wrong answer.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from hybrid_offload.core.secrets import Secret

__all__ = ["EXPIRY_SCHEMES", "RemoteExpiry", "make_expiry"]

logger = logging.getLogger(__name__)

#: URL schemes whose values can expire
EXPIRY_SCHEMES = ("redis", "rediss", "unix", "fs")
#: LMCache's two Redis values per page
_REDIS_SUFFIXES = ("kv_bytes", "metadata")


class RemoteExpiry:
    """No expiry (remotes other than Redis and fs). Subclasses expire values ``ttl_s`` after
    their last write or hit; every method may raise on I/O (the caller logs and counts it)."""

    def refresh(self, names: Sequence[str]) -> None:
        """Values ``names`` (LMCache key strings) were just written or read: expire them later."""

    def sweep(self) -> int:
        """Remove this namespace's values untouched for longer than ``ttl_s``; return how many."""
        return 0

    def close(self) -> None:
        """Release connections; idempotent."""


class _RedisExpiry(RemoteExpiry):
    def __init__(self, url: str, ttl_s: float, password: Secret | None) -> None:
        import redis

        parts = urlsplit(url)
        query = {k: v for k, v in parse_qsl(parts.query) if k in ("socket_timeout", "socket_connect_timeout")}
        self._client = redis.Redis.from_url(
            urlunsplit(parts._replace(query=urlencode(query))),
            password=None if password is None else password.text(),
        )
        self._ttl_ms = max(1, round(ttl_s * 1000))

    def refresh(self, names: Sequence[str]) -> None:
        if not names:
            return
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            for suffix in _REDIS_SUFFIXES:
                pipe.pexpire(name + suffix, self._ttl_ms)
        pipe.execute()

    def close(self) -> None:
        self._client.close()


class _FsExpiry(RemoteExpiry):
    def __init__(self, url: str, ttl_s: float, namespace: str, clock: Callable[[], float]) -> None:
        self._dirs = [Path(p.strip()) for p in urlsplit(url).path.split(",") if p.strip()]
        self._ttl_s = ttl_s
        self._clock = clock
        self._pattern = re.compile(re.escape(namespace) + r"-[0-9a-f]+@1@0@1[0-9a-f]+@uint8\.data")

    def _path(self, name: str) -> Path | None:
        """The file of value ``name`` (LMCache spreads keys over its paths; try each)."""
        for directory in self._dirs:
            path = directory / (name.replace("/", "-SEP-") + ".data")
            if path.exists():
                return path
        return None

    def refresh(self, names: Sequence[str]) -> None:
        now = self._clock()
        for name in names:
            path = self._path(name)
            if path is not None:
                os.utime(path, (now, now))

    def sweep(self) -> int:
        limit = self._clock() - self._ttl_s
        removed = 0
        for directory in self._dirs:
            try:
                entries = list(os.scandir(directory))
            except FileNotFoundError:
                continue
            for entry in entries:
                if not self._pattern.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
                    continue
                if entry.stat(follow_symlinks=False).st_mtime < limit:
                    try:
                        os.unlink(entry.path)
                        removed += 1
                    except FileNotFoundError:
                        pass  # another process swept it first
        return removed


def make_expiry(
    url: str,
    ttl_s: float | None,
    namespace: str,
    clock: Callable[[], float] = time.time,
    *,
    password: Secret | None = None,
) -> RemoteExpiry:
    """The expiry for ``url`` (a no-op without ``ttl_s`` or for other schemes); connects lazily,
    with ``password`` (a Redis remote's AUTH; ``url`` holds none)."""
    scheme = urlsplit(url).scheme
    if ttl_s is None or scheme not in EXPIRY_SCHEMES:
        return RemoteExpiry()
    if scheme == "fs":
        return _FsExpiry(url, ttl_s, namespace, clock)
    return _RedisExpiry(url, ttl_s, password)
