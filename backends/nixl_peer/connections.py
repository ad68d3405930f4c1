"""Admission and timeouts of the cache peer's control connections (bookkeeping, no I/O).

A peer serves one thread per connection, so connections are what an untrusted client can pile
up. :class:`ConnectionTable` bounds them:

* at most ``max_connections`` in all: a new one beyond that is refused (the server answers
  ``BUSY`` and closes it), unless a connection still without HELLO can make room;
* at most ``max_unauthenticated`` that have not completed HELLO: a new one beyond that pushes
  out the *oldest* such connection (a flood of silent connections cannot lock real clients
  out; they greet at once);
* a connection without HELLO ``handshake_timeout_s`` after it was accepted, or greeted but
  without a request for ``idle_timeout_s``, is returned by :meth:`ConnectionTable.expired` for
  the server to close (a client reconnects transparently on its next call).

Times come from the injected ``clock``. Thread-safe (its own lock).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Connection", "ConnectionTable", "Limits"]


@dataclass(frozen=True)
class Limits:
    """Connection limits; every value > 0."""

    max_connections: int = 1000
    max_unauthenticated: int = 64
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 600.0


@dataclass(eq=False)
class Connection:
    """One client connection; also the owner tag of its leases and reservations."""

    sock: socket.socket
    address: str
    accepted_at: float
    last_active: float = 0.0
    greeted: bool = False


class ConnectionTable:
    """The open connections and the limits above (see the module docstring)."""

    def __init__(self, limits: Limits, clock: Callable[[], float]) -> None:
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[Connection, None] = {}  # insertion order = accept order

    def now(self) -> float:
        return self._clock()

    def admit(self, conn: Connection) -> tuple[bool, Connection | None]:
        """``(admitted, pushed_out)``: whether ``conn`` may be served, and a connection without
        HELLO that was dropped to make room (the caller closes it)."""
        with self._lock:
            waiting = [c for c in self._open if not c.greeted]
            pushed = None
            full = len(self._open) >= self.limits.max_connections
            if waiting and (full or len(waiting) >= self.limits.max_unauthenticated):
                pushed = waiting[0]
                del self._open[pushed]
            elif full:
                return False, None
            conn.last_active = conn.accepted_at
            self._open[conn] = None
            return True, pushed

    def greeted(self, conn: Connection) -> None:
        """``conn`` completed HELLO: from now on the idle timeout applies."""
        with self._lock:
            conn.greeted = True
            conn.last_active = self._clock()

    def touch(self, conn: Connection) -> None:
        """``conn`` sent a request now."""
        conn.last_active = self._clock()

    def remove(self, conn: Connection) -> None:
        with self._lock:
            self._open.pop(conn, None)

    def connections(self) -> list[Connection]:
        with self._lock:
            return list(self._open)

    def counts(self) -> tuple[int, int]:
        """``(open, without HELLO)``."""
        with self._lock:
            return len(self._open), sum(1 for c in self._open if not c.greeted)

    def expired(self) -> list[tuple[Connection, str]]:
        """Remove and return the connections past their timeout, with the reason."""
        now = self._clock()
        limits = self.limits
        out: list[tuple[Connection, str]] = []
        with self._lock:
            for conn in list(self._open):
                if not conn.greeted and now - conn.accepted_at >= limits.handshake_timeout_s:
                    out.append((conn, f"no HELLO within {limits.handshake_timeout_s:g}s"))
                elif conn.greeted and now - conn.last_active >= limits.idle_timeout_s:
                    out.append((conn, f"idle for {limits.idle_timeout_s:g}s"))
            for conn, _ in out:
                del self._open[conn]
        return out
