"""The peer handshake: both sides prove they hold the shared token; the token never crosses
the wire.

=====  ======================================  ===============================================
step   message                                  check
=====  ======================================  ===============================================
1      client -> HELLO(cn, name)                cn: 32 random bytes
2      peer -> CHALLENGE(pn, peer proof)        client: peer proof = HMAC(token, "peer" cn pn)
3      client -> PROVE(client proof)            peer: client proof = HMAC(token, "client" cn pn)
4      peer -> HelloReply(fields, mac)          client: mac = HMAC(token, "welcome" cn pn fields)
=====  ======================================  ===============================================

So a process that holds the peer's port without the token (a local user who bound it while
the peer restarted) learns nothing from a client and fails at step 2, before the client uses
anything it sent; a peer never hands its NIXL metadata (step 4) to a client that did not prove
the token; and the metadata the client loads into its NIXL agent is the one the peer sent.
Each side's nonce makes every proof single-use; labels keep the three MACs apart.

Limits: the later messages are not authenticated (a machine in the middle that relays the
whole handshake could then alter keys and extents in flight; pages are still verified by
their checksums and signatures), and nothing is encrypted. Without a token (``--insecure``)
the key is empty: the exchange runs and proves nothing.
"""

from __future__ import annotations

import hmac
import os
import socket
from collections.abc import Callable

from . import protocol as p

__all__ = [
    "NONCE_BYTES", "PeerAuthError", "challenge", "check_client", "client_handshake", "raw_handshake",
    "welcome_mac",
]

NONCE_BYTES = 32


class PeerAuthError(ConnectionRefusedError):
    """The other side of the handshake did not prove the token (or broke the handshake)."""


def _mac(token: bytes, label: bytes, cn: bytes, pn: bytes, extra: bytes = b"") -> bytes:
    return hmac.digest(token, b"hybrid-offload/peer-handshake/" + label + b"\0" + cn + pn + extra, "sha256")


def _nonce_ok(nonce: bytes) -> bool:
    return len(nonce) == NONCE_BYTES


def challenge(token: bytes, hello: p.Hello) -> tuple[p.Challenge, bytes]:
    """The peer's step 2: ``(CHALLENGE, peer nonce)``; ProtocolError for a malformed nonce."""
    if not _nonce_ok(hello.nonce):
        raise p.ProtocolError(p.ErrorCode.MALFORMED, f"HELLO nonce must be {NONCE_BYTES} bytes")
    pn = os.urandom(NONCE_BYTES)
    return p.Challenge(pn, _mac(token, b"peer", hello.nonce, pn)), pn


def check_client(token: bytes, cn: bytes, pn: bytes, prove: p.Prove) -> bool:
    """The peer's step 3: whether the client proved the token."""
    return hmac.compare_digest(prove.proof, _mac(token, b"client", cn, pn))


def welcome_mac(token: bytes, cn: bytes, pn: bytes, reply: p.HelloReply) -> bytes:
    """The MAC of step 4 over ``reply``'s fields."""
    return _mac(token, b"welcome", cn, pn, reply.fields())


_REFUSALS = {p.ErrorCode.AUTH_FAILED: "wrong token", p.ErrorCode.BUSY: "peer busy"}


def _refused(reply: p.Message | None) -> None:
    if isinstance(reply, p.Error):
        what = _REFUSALS.get(reply.code, "handshake refused")  # type: ignore[call-overload]
        raise ConnectionRefusedError(f"peer refused the connection ({what}): {reply.message}")


def client_handshake(
    exchange: Callable[[p.Message], p.Message | None], token: bytes, name: str
) -> p.HelloReply:
    """Run steps 1-4 over ``exchange`` (send a request, return its reply) and return the
    checked HelloReply. Raises :class:`PeerAuthError` when the peer fails to prove the token,
    ConnectionRefusedError naming the reason when it refuses, ProtocolError when it answers
    out of turn."""
    cn = os.urandom(NONCE_BYTES)
    reply = exchange(p.Hello(cn, name))
    _refused(reply)
    if not isinstance(reply, p.Challenge) or not _nonce_ok(reply.nonce):
        raise p.ProtocolError(p.ErrorCode.MALFORMED, f"HELLO answered by {type(reply).__name__}")
    if not hmac.compare_digest(reply.proof, _mac(token, b"peer", cn, reply.nonce)):
        raise PeerAuthError(
            "the peer did not prove our token (wrong token, or another process holds its address)"
        )
    pn = reply.nonce
    welcome = exchange(p.Prove(_mac(token, b"client", cn, pn)))
    _refused(welcome)
    if not isinstance(welcome, p.HelloReply):
        raise p.ProtocolError(p.ErrorCode.MALFORMED, f"PROVE answered by {type(welcome).__name__}")
    if not hmac.compare_digest(welcome.mac, welcome_mac(token, cn, pn, welcome)):
        raise PeerAuthError("the peer's HELLO reply was altered in transit (its MAC does not match)")
    return welcome


def raw_handshake(sock: socket.socket, token: bytes, name: str) -> p.HelloReply:
    """:func:`client_handshake` on a bare socket (request ids 1 and 2): for tools and tests
    that speak the protocol directly."""
    ids = iter((1, 2))

    def exchange(message: p.Message) -> p.Message:
        p.send_message(sock, message, next(ids))
        return p.recv_message(sock)[0]

    return client_handshake(exchange, token, name)
