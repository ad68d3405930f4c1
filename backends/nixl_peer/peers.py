"""Per-peer client state of the nixl_peer backend: address parsing, connection and backoff."""

from __future__ import annotations

import socket
import threading
import time

from . import protocol as p


def parse_address(address: object) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ValueError if malformed."""
    if not isinstance(address, str):
        raise ValueError(f"peer address must be a 'host:port' string, got {address!r}")
    host, sep, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"peer address must be 'host:port', got {address!r}")
    return host, int(port_text)


class PeerDownError(Exception):
    """This peer cannot serve the call now (down, backing off, refused, failed)."""


class PeerState:
    """One peer's connection and health, as a client sees it; ``lock`` guards the socket."""

    def __init__(self, address: str, backoff: float) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self.lock = threading.Lock()  # the socket and request ids
        self.sock: socket.socket | None = None
        self.hello: p.HelloReply | None = None
        self.request_id = 0
        self.unanswered = 0  # requests sent without waiting; their replies are skipped later
        self.down_until = 0.0
        self.failing = False  # the last call failed (unlike is_down(), not time-bound)
        self.backoff = backoff
        self.last_error = ""
        self.remote_agent: str | None = None  # loaded into our agent (under the xfer lock)

    def is_down(self) -> bool:
        return self.down_until > time.monotonic()
