"""Per-peer client state of the nixl_peer backend: address parsing, connection and backoff."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

from ..health import BackendHealth
from . import protocol as p
from .auth import Session, client_handshake

logger = logging.getLogger(__name__)

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

    def __init__(self, address: str, backoff: float, max_backoff: float) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self.lock = threading.Lock()  # the socket and request ids
        self.sock: socket.socket | None = None
        self.hello: p.HelloReply | None = None
        self.session: Session | None = None  # seals the frames of the current connection
        self.request_id = 0
        self.unanswered = 0  # requests sent without waiting; their replies are skipped later
        #: the backend's backoff, per peer: down from a failure until a call succeeds again
        self.health = BackendHealth(f"nixl peer {address}", backoff, max_backoff)
        self.last_error = ""
        self.remote_agent: str | None = None  # loaded into our agent (under the xfer lock)

    def is_down(self) -> bool:
        """Whether calls to this peer wait out its backoff now (after it, one call probes)."""
        return not self.health.available()

    def disconnect(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        self.sock = None
        self.session = None
        self.unanswered = 0

    def exchange(self, request: p.Message, *, wait: bool = True) -> p.Message | None:
        """Send ``request`` and read its reply, first skipping the replies to earlier requests
        sent with ``wait=False`` (RELEASE: nothing to wait for, saves a round trip per load)."""
        assert self.sock is not None
        self.request_id = (self.request_id + 1) & 0xFFFFFFFF
        p.send_message(self.sock, request, self.request_id, self.session)
        if not wait:
            self.unanswered += 1
            return None
        while True:
            reply, request_id = p.recv_message(self.sock, session=self.session)
            # an ERROR with request id 0 is about the connection (framing): it answers this call
            stale = request_id != self.request_id and not (isinstance(reply, p.Error) and request_id == 0)
            if self.unanswered and stale:
                self.unanswered -= 1
                continue
            if stale:
                raise p.ProtocolError(p.ErrorCode.MALFORMED, f"reply to request {request_id}")
            return reply

    def connect(self, token: bytes, name: str, timeout: float) -> None:
        """Connect and run the handshake (:mod:`.auth`) for this peer's address; raises
        OSError / ProtocolError (ConnectionRefusedError naming the reason when the peer refuses
        or fails to prove the token for that address)."""
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(timeout)
            self.sock = sock
            reply, self.session = client_handshake(self.exchange, token, name, self.address)
        except BaseException:
            self.disconnect()
            raise
        if self.hello is None or self.hello.agent_name != reply.agent_name:
            logger.info("nixl peer %s is agent %s", self.address, reply.agent_name)
        self.hello = reply
