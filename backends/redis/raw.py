"""Pipelined GETRANGE replies received straight into the caller's buffers (redis ``get_into``).

redis-py (hiredis) parses every reply into a fresh ``bytes`` that the backend then copied into
the caller's buffer: for a load of 172 pages of 70 KB from a loopback server that parse and copy
took 15.7 ms, against 5.2 ms receiving each value with ``recv_into`` where it belongs
(``benchmarks/e2e.md``). This module speaks just enough RESP2 for that, on connections of its
own, for a standalone server reached over plain TCP (``redis://``); TLS and cluster backends
keep redis-py's path.

Contract:

* :meth:`RawReader.read_into` sends ``GETRANGE key 0 end`` for every key in one pipeline and
  receives each value into its view: per key the value's full length (0 for an absent key or an
  empty value, which GETRANGE cannot tell apart). A value longer than its view fills the view;
  the rest is read and dropped, and its length, larger than the view, is returned.
* Any failure (connect, authentication, timeout, a closed or garbled stream, an error reply)
  closes that connection, whose position in the stream is then unknown, and raises a redis-py
  exception (``ConnectionError``, ``TimeoutError``, ``AuthenticationError``, ``ResponseError``;
  all ``RedisError``). The next call connects again.
* A kept connection the server dropped (it restarted, or closed idle clients) is not a failure:
  when one closes or resets under a call, every kept connection is closed and the call is sent
  once more on a new connection (GETRANGE is a read; the views are filled again), as redis-py's
  one retry does for the backend's other commands.
* Thread-safe: each call takes an idle connection or opens one; at most ``max_idle`` idle ones
  are kept. ``close()`` closes the idle ones; a connection in use is closed when its call ends.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["RawReader", "raw_reader_for"]

#: bytes asked per header read: a reply header and the CRLF before it are < 32 bytes
_HEADER_READ = 64
_MAX_LINE = 1 << 16
_SKIP_CHUNK = 1 << 16


def _command(*args: bytes | str | int) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class _DroppedError(RedisConnectionError):
    """The server closed or reset the connection."""


class _Connection:
    """One socket and the few bytes read past the last reply's header."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()

    def _fill(self) -> None:
        chunk = self.sock.recv(_HEADER_READ)
        if not chunk:
            raise _DroppedError("the redis server closed the connection")
        self.pending += chunk

    def line(self) -> bytes:
        while (end := self.pending.find(b"\r\n")) < 0:
            if len(self.pending) > _MAX_LINE:
                raise RedisConnectionError("garbled reply from the redis server (no line end)")
            self._fill()
        line = bytes(self.pending[:end])
        del self.pending[: end + 2]
        return line

    def into(self, view: memoryview) -> None:
        """Fill ``view`` from the stream."""
        done = min(len(self.pending), view.nbytes)
        view[:done] = self.pending[:done]
        del self.pending[:done]
        while done < view.nbytes:
            got = self.sock.recv_into(view[done:])
            if got == 0:
                raise _DroppedError("the redis server closed the connection")
            done += got

    def skip(self, count: int) -> None:
        """Read and drop ``count`` bytes."""
        scratch = memoryview(bytearray(min(count, _SKIP_CHUNK))) if count > len(self.pending) else None
        while count > 0:
            if self.pending:
                take = min(count, len(self.pending))
                del self.pending[:take]
            else:
                assert scratch is not None
                take = min(count, scratch.nbytes)
                self.into(scratch[:take])
            count -= take

    def reply_into(self, view: memoryview) -> int:
        """One bulk-string reply into ``view``; its full length."""
        line = self.line()
        if line[:1] == b"-":
            raise ResponseError(line[1:].decode("utf-8", "replace"))
        if line[:1] != b"$" or not line[1:].lstrip(b"-").isdigit():
            raise RedisConnectionError(f"unexpected reply from the redis server: {line[:32]!r}")
        length = int(line[1:])
        if length < 0:  # nil: GETRANGE never answers it, but a nil holds no bytes either
            return 0
        take = min(length, view.nbytes)
        self.into(view[:take])
        self.skip(length - take + 2)  # the rest of a longer value, and the CRLF
        return length

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class RawReader:
    """Bulk GETRANGE reads on connections of its own (see the module docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        connect_timeout_s: float = 5.0,
        socket_timeout_s: float = 5.0,
        max_idle: int = 4,
    ) -> None:
        self._address = (host, port)
        self._hello: list[bytes] = []
        if password is not None:
            args = ("AUTH", username, password) if username else ("AUTH", password)
            self._hello.append(_command(*args))
        if db:
            self._hello.append(_command("SELECT", db))
        self._connect_timeout = connect_timeout_s
        self._socket_timeout = socket_timeout_s
        self._max_idle = max_idle
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self) -> _Connection:
        try:
            sock = socket.create_connection(self._address, timeout=self._connect_timeout)
        except TimeoutError as exc:
            raise RedisTimeoutError(f"connecting to {self._address[0]}:{self._address[1]}: {exc}") from exc
        except OSError as exc:
            raise RedisConnectionError(f"connecting to {self._address[0]}:{self._address[1]}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self._socket_timeout)
        conn = _Connection(sock)
        try:
            if self._hello:
                sock.sendall(b"".join(self._hello))
                for _ in self._hello:
                    line = conn.line()
                    if line[:1] == b"-":
                        what = line[1:].decode("utf-8", "replace")
                        auth = what.startswith(("WRONGPASS", "NOAUTH", "NOPERM")) or "AUTH" in what
                        raise AuthenticationError(what) if auth else ResponseError(what)
        except BaseException:
            conn.close()
            raise
        return conn

    def _take(self) -> tuple[_Connection, bool]:
        """An idle connection (True: kept from an earlier call) or a new one (False)."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _give(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def read_into(self, keys: Sequence[str], ends: Sequence[int], views: Sequence[memoryview]) -> list[int]:
        """``GETRANGE key 0 end`` per key, each value received into its view; the values'
        full lengths (see the module docstring)."""
        if not keys:
            return []
        request = b"".join(_command("GETRANGE", k, 0, e) for k, e in zip(keys, ends, strict=True))
        conn, kept = self._take()
        try:
            return self._exchange(conn, request, views)
        except _DroppedError:
            if not kept:
                raise
        self._drop_idle()  # kept ones opened before the server dropped this one are stale too
        return self._exchange(self._connect(), request, views)

    def _exchange(self, conn: _Connection, request: bytes, views: Sequence[memoryview]) -> list[int]:
        """Send ``request`` on ``conn`` and receive one reply per view; ``conn`` is kept after
        a success and closed after any failure."""
        try:
            conn.sock.sendall(request)
            lengths = [conn.reply_into(view) for view in views]
        except TimeoutError as exc:
            conn.close()
            raise RedisTimeoutError(f"reading from {self._address[0]}:{self._address[1]}: {exc}") from exc
        except OSError as exc:
            conn.close()
            raise _DroppedError(f"reading from {self._address[0]}:{self._address[1]}: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        self._give(conn)
        return lengths

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def raw_reader_for(url: str, password: str | None, options: Mapping[str, Any]) -> RawReader | None:
    """A reader for a standalone server at ``url`` with the backend's (validated) ``options``,
    or None where redis-py's path stays (TLS, cluster urls)."""
    parts = urlsplit(url)
    if parts.scheme != "redis" or not parts.hostname:
        return None
    db = parts.path.strip("/")
    return RawReader(
        parts.hostname,
        parts.port or 6379,
        db=int(db) if db else 0,
        username=unquote(parts.username) if parts.username else None,
        password=password,
        connect_timeout_s=float(options["connect_timeout_s"]),
        socket_timeout_s=float(options["socket_timeout_s"]),
        max_idle=min(4, int(options["max_connections"])),
    )
