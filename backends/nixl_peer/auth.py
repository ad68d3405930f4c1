"""The peer handshake and the session it opens: both sides prove they hold the shared token
and that the client reached the peer it dialed; the token never crosses the wire; every frame
after the handshake carries a MAC under a key only the two of them know.

=====  ===========================================  ==========================================
step   message                                       check
=====  ===========================================  ==========================================
1      client -> HELLO(cn, name, dialed)             peer: ``dialed`` names this peer (below)
2      peer -> CHALLENGE(pn, peer proof)             client: HMAC(token, "peer" cn pn dialed)
3      client -> PROVE(client proof)                 peer: HMAC(token, "client" cn pn dialed)
4      peer -> HelloReply(fields, mac)               client: HMAC(token, "welcome" cn pn dialed
                                                     fields); ``fields`` hold the peer's agent
                                                     name and NIXL metadata
=====  ===========================================  ==========================================

``dialed`` is the ``host:port`` the client was configured with. A peer proves only an address
it answers to (:func:`.exposure.names_this_peer`: its ``--advertise`` addresses, or its own port
on an address of the interface the connection came in on). So a process that holds a ring
peer's address while that peer is down, without the token, cannot relay a client's handshake
to another ring peer: relayed as it is, the other peer refuses the address; rewritten, the
proof no longer covers the address the client dialed. A client also refuses one agent name at
two of its addresses (:class:`.client.NixlPeerBackend`).

After step 4 both sides hold ``session key = HMAC(token, "session" cn pn dialed agent)`` and
:class:`Session` seals every later frame: a tag (HMAC-SHA256 truncated to :data:`TAG_BYTES`)
over the direction, the frame's sequence number in that direction (never sent: both count),
the header and the body. A frame altered, injected, dropped, replayed or reflected in transit
fails the next check, and the side that sees it closes the connection. Each side's nonce makes
every proof and every session key single-use; labels keep the MACs apart.

Limits: nothing is encrypted (keys and sizes are visible on the wire; page bytes move over
NIXL, checked by their checksums and signatures). Without a token (``insecure``) the key is
empty: the exchange runs and proves nothing.
"""

from __future__ import annotations

import hmac
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from . import protocol as p
from .codec import U64, blob16_field

__all__ = [
    "NONCE_BYTES", "TAG_BYTES", "PeerAuthError", "RawChannel", "Session", "challenge", "check_client",
    "client_handshake", "raw_handshake", "welcome_mac",
]

NONCE_BYTES = 32
TAG_BYTES = p.TAG_BYTES


class PeerAuthError(ConnectionRefusedError):
    """The other side of the handshake did not prove the token (or broke the handshake)."""


def _mac(token: bytes, label: bytes, cn: bytes, pn: bytes, dialed: str, extra: bytes = b"") -> bytes:
    bound = cn + pn + blob16_field(dialed.encode())
    return hmac.digest(token, b"hybrid-offload/peer-handshake/" + label + b"\0" + bound + extra, "sha256")


def _nonce_ok(nonce: bytes) -> bool:
    return len(nonce) == NONCE_BYTES


class Session:
    """Seals and checks the frames of one connection after its handshake (one thread per
    side: the counters are not locked). ``client``: which side this is."""

    def __init__(self, key: bytes, *, client: bool) -> None:
        self._key = key
        self._out, self._in = (b"c2p", b"p2c") if client else (b"p2c", b"c2p")
        self._sent = 0
        self._received = 0

    def _tag(self, direction: bytes, seq: int, header: bytes, body: bytes) -> bytes:
        message = direction + U64.pack(seq) + header + body
        return hmac.digest(self._key, message, "sha256")[:TAG_BYTES]

    def seal(self, header: bytes, body: bytes) -> bytes:
        """The tag of the next frame sent."""
        tag = self._tag(self._out, self._sent, header, body)
        self._sent += 1
        return tag

    def check(self, header: bytes, body: bytes, tag: bytes) -> None:
        """Check the next frame received; ProtocolError (``AUTH_FAILED``) if its tag is wrong."""
        want = self._tag(self._in, self._received, header, body)
        self._received += 1
        if not hmac.compare_digest(tag, want):
            why = "a frame failed its session MAC (altered, injected or replayed in transit)"
            raise p.ProtocolError(p.ErrorCode.AUTH_FAILED, why)


def _session(token: bytes, cn: bytes, pn: bytes, dialed: str, agent_name: str, *, client: bool) -> Session:
    return Session(_mac(token, b"session", cn, pn, dialed, blob16_field(agent_name.encode())), client=client)


def challenge(token: bytes, hello: p.Hello) -> tuple[p.Challenge, bytes]:
    """The peer's step 2 (``hello.dialed`` already checked): ``(CHALLENGE, peer nonce)``;
    ProtocolError for a malformed nonce."""
    if not _nonce_ok(hello.nonce):
        raise p.ProtocolError(p.ErrorCode.MALFORMED, f"HELLO nonce must be {NONCE_BYTES} bytes")
    pn = os.urandom(NONCE_BYTES)
    return p.Challenge(pn, _mac(token, b"peer", hello.nonce, pn, hello.dialed)), pn


def check_client(token: bytes, hello: p.Hello, pn: bytes, prove: p.Prove) -> bool:
    """The peer's step 3: whether the client proved the token."""
    return hmac.compare_digest(prove.proof, _mac(token, b"client", hello.nonce, pn, hello.dialed))


def welcome_mac(token: bytes, hello: p.Hello, pn: bytes, reply: p.HelloReply) -> bytes:
    """The MAC of step 4 over ``reply``'s fields."""
    return _mac(token, b"welcome", hello.nonce, pn, hello.dialed, reply.fields())


def peer_session(token: bytes, hello: p.Hello, pn: bytes, reply: p.HelloReply) -> Session:
    """The peer's side of the session opened by ``reply`` (step 4)."""
    return _session(token, hello.nonce, pn, hello.dialed, reply.agent_name, client=False)


_REFUSALS = {
    p.ErrorCode.AUTH_FAILED: "wrong token",
    p.ErrorCode.BUSY: "peer busy",
    p.ErrorCode.NOT_THIS_PEER: "another peer answers at that address",
}


def _refused(reply: p.Message | None) -> None:
    if isinstance(reply, p.Error):
        what = _REFUSALS.get(reply.code, "handshake refused")  # type: ignore[call-overload]
        raise ConnectionRefusedError(f"peer refused the connection ({what}): {reply.message}")


def client_handshake(
    exchange: Callable[[p.Message], p.Message | None], token: bytes, name: str, dialed: str
) -> tuple[p.HelloReply, Session]:
    """Run steps 1-4 over ``exchange`` (send a request, return its reply) with the peer dialed
    at ``dialed``; return the checked HelloReply and the client's :class:`Session`. Raises
    :class:`PeerAuthError` when the peer fails to prove the token for that address,
    ConnectionRefusedError naming the reason when it refuses, ProtocolError when it answers
    out of turn."""
    cn = os.urandom(NONCE_BYTES)
    reply = exchange(p.Hello(cn, name, dialed))
    _refused(reply)
    if not isinstance(reply, p.Challenge) or not _nonce_ok(reply.nonce):
        raise p.ProtocolError(p.ErrorCode.MALFORMED, f"HELLO answered by {type(reply).__name__}")
    pn = reply.nonce
    if not hmac.compare_digest(reply.proof, _mac(token, b"peer", cn, pn, dialed)):
        raise PeerAuthError(
            f"the peer did not prove our token for {dialed} (wrong token, or another process holds "
            "its address and relays to someone else)"
        )
    welcome = exchange(p.Prove(_mac(token, b"client", cn, pn, dialed)))
    _refused(welcome)
    if not isinstance(welcome, p.HelloReply):
        raise p.ProtocolError(p.ErrorCode.MALFORMED, f"PROVE answered by {type(welcome).__name__}")
    if not hmac.compare_digest(welcome.mac, _mac(token, b"welcome", cn, pn, dialed, welcome.fields())):
        raise PeerAuthError("the peer's HELLO reply was altered in transit (its MAC does not match)")
    return welcome, _session(token, cn, pn, dialed, welcome.agent_name, client=True)


@dataclass
class RawChannel:
    """A handshaken connection for tools and tests that speak the protocol directly."""

    sock: socket.socket
    hello: p.HelloReply
    session: Session

    def send(self, message: p.Message, request_id: int) -> None:
        p.send_message(self.sock, message, request_id, self.session)

    def recv(self) -> tuple[p.Message, int]:
        return p.recv_message(self.sock, session=self.session)

    def ask(self, message: p.Message, request_id: int = 3) -> p.Message:
        """Send ``message`` and return its reply."""
        self.send(message, request_id)
        return self.recv()[0]

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def dialed_address(sock: socket.socket) -> str:
    """``host:port`` of the other end of a connected socket (brackets around IPv6)."""
    host, port = sock.getpeername()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def raw_handshake(sock: socket.socket, token: bytes, name: str, dialed: str | None = None) -> RawChannel:
    """:func:`client_handshake` on a bare socket (request ids 1 and 2); ``dialed`` defaults to
    the address the socket is connected to."""
    ids = iter((1, 2))

    def exchange(message: p.Message) -> p.Message:
        p.send_message(sock, message, next(ids))
        return p.recv_message(sock)[0]

    hello, session = client_handshake(exchange, token, name, dialed or dialed_address(sock))
    return RawChannel(sock, hello, session)
