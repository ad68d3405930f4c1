"""nixl_peer control protocol: every message round-trips; malformed input is rejected."""

from __future__ import annotations

import dataclasses
import socket
import struct

import pytest

from hybrid_offload.backends.nixl_peer import protocol as p
from hybrid_offload.backends.nixl_peer.auth import (
    PeerAuthError,
    Session,
    challenge,
    check_client,
    client_handshake,
    peer_session,
    welcome_mac,
)
from hybrid_offload.backends.nixl_peer.exposure import names_this_peer

K1 = "5eed0001-" + "ab" * 16
K2 = "0123abcd-" + "0" * 64

MESSAGES: list[p.Message] = [
    p.Hello(b"n" * 32, "client-1", "peer-0.example:5555"),
    p.Hello(b"", "", ""),
    p.Challenge(b"n" * 32, b"p" * 32),
    p.Prove(b"c" * 32),
    p.HelloReply("peer-x", b"\x00metadata\xff" * 100, 0x7F0000001000, 1 << 30, 1 << 29, b"m" * 32),
    p.Lookup([K1, K2, K1]),
    p.Lookup([]),
    p.LookupReply([True, False, True, True, False, False, False, False, True]),
    p.LookupReply([]),
    p.Get([K1, K2]),
    p.GetReply(7, [(0, 100), None, (4096, 0), ((1 << 64) - 2, 5)]),
    p.Release(123456789),
    p.ReleaseReply(True),
    p.Alloc([K1, K2], [0, (1 << 40)]),
    p.AllocReply(9, [64, None, 0]),
    p.Commit(9, [True, False, True]),
    p.CommitReply(2, 1, 1000),
    p.Delete([K2]),
    p.DeleteReply(1),
    p.Used(),
    p.UsedReply(1, 2, 3, 4),
    p.Error(p.ErrorCode.AUTH_FAILED, "wrong token ü"),
]


def _roundtrip(message: p.Message, request_id: int = 42) -> tuple[p.Message, int]:
    frame = p.encode(message, request_id)
    msg_type, rid, length = p.decode_header(frame[: p.HEADER.size])
    assert length == len(frame) - p.HEADER.size
    return p.decode_body(msg_type, frame[p.HEADER.size :]), rid


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: p.Message) -> None:
    decoded, rid = _roundtrip(message)
    assert decoded == message
    assert rid == 42


def test_reply_types_are_request_types_with_high_bit() -> None:
    pairs = [(p.Hello, p.Challenge), (p.Prove, p.HelloReply), (p.Lookup, p.LookupReply), (p.Get, p.GetReply),
             (p.Release, p.ReleaseReply), (p.Alloc, p.AllocReply), (p.Commit, p.CommitReply),
             (p.Delete, p.DeleteReply), (p.Used, p.UsedReply)]  # fmt: skip
    assert len({req.TYPE for req, _ in pairs} | {rep.TYPE for _, rep in pairs}) == 18
    for request, reply in pairs:
        assert reply.TYPE == request.TYPE | 0x80


def test_header_is_compact_and_versioned() -> None:
    frame = p.encode(p.Used(), 5)
    assert frame == b"HOPP" + bytes([p.VERSION, p.Used.TYPE]) + b"\0\0" + struct.pack("!II", 5, 0)


def _header(magic: bytes = p.MAGIC, version: int = p.VERSION, msg_type: int = 2, flags: int = 0,
            length: int = 0) -> bytes:  # fmt: skip
    return p.HEADER.pack(magic, version, msg_type, flags, 1, length)


@pytest.mark.parametrize(
    ("header", "code"),
    [
        (_header(magic=b"HTTP"), p.ErrorCode.MALFORMED),
        (_header(version=1), p.ErrorCode.UNSUPPORTED_VERSION),  # sent the token in HELLO
        (_header(version=p.VERSION + 1), p.ErrorCode.UNSUPPORTED_VERSION),
        (_header(msg_type=99), p.ErrorCode.MALFORMED),
        (_header(flags=1), p.ErrorCode.MALFORMED),
        (_header(length=p.MAX_BODY + 1), p.ErrorCode.TOO_LARGE),
        (_header()[:10], p.ErrorCode.MALFORMED),
    ],
)
def test_bad_headers_rejected(header: bytes, code: p.ErrorCode) -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_header(header)
    assert info.value.code == code


def _body(message: p.Message) -> tuple[int, bytes]:
    return message.TYPE, message.body()


@pytest.mark.parametrize(
    ("msg_type", "body"),
    [
        (p.Lookup.TYPE, b"\0\0\0\x01"),  # one key announced, none present
        (p.Lookup.TYPE, b"\0\0\0\x01\x05../..",),  # not a page key
        (p.Lookup.TYPE, b"\0\0\0\x01\x11" + b"ABCDEF01-01234567"),  # uppercase
        (p.Lookup.TYPE, b"\0\0\0\x01\x11" + "5eed0001-0123456é".encode()[:17]),  # non-ASCII
        (p.Lookup.TYPE, p.Lookup([K1]).body() + b"x"),  # trailing bytes
        (p.Lookup.TYPE, struct.pack("!I", p.MAX_KEYS + 1)),  # too many keys
        (p.Alloc.TYPE, p.Lookup([K1, K2]).body() + struct.pack("!Q", 1)),  # one size for two keys
        (p.Get.TYPE, b""),
        (p.Release.TYPE, b"\0\0\0"),
        (p.Commit.TYPE, struct.pack("!QI", 1, 9) + b"\x01"),  # 9 flags need 2 bytes
        (p.Hello.TYPE, b"\x00\x05abc"),  # token shorter than announced
        (p.Hello.TYPE, b"\x00\x00\x00\x02\xff\xfe"),  # client name not UTF-8
        (p.GetReply.TYPE, struct.pack("!QI", 1, 2) + b"\0" * 24),
        (p.Used.TYPE, b"\0"),
        (200, b""),
    ],
)
def test_malformed_bodies_rejected(msg_type: int, body: bytes) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode_body(msg_type, body)


def test_encode_refuses_oversized_body() -> None:
    keys = ["5eed0001-" + f"{i:064x}" for i in range(p.MAX_BODY // 70 + 10)]
    with pytest.raises(ValueError, match="exceeds"):
        p.encode(p.Lookup(keys), 1)


def test_alloc_needs_one_size_per_key() -> None:
    with pytest.raises(p.ProtocolError):
        p.Alloc([K1], [1, 2])


def test_socket_framing() -> None:
    left, right = socket.socketpair()
    with left, right:
        p.send_message(left, p.Get([K1]), 3)
        p.send_message(left, p.Used(), 4)
        assert p.recv_message(right) == (p.Get([K1]), 3)
        assert p.recv_message(right) == (p.Used(), 4)
        left.sendall(p.encode(p.Used(), 5)[:7])
        left.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError):
            p.recv_message(right)


# -- sessions (issue 45 N1): every frame after the handshake carries a MAC ----------------------


def _pair() -> tuple[Session, Session]:
    key = b"k" * 32
    return Session(key, client=True), Session(key, client=False)


def test_sealed_frames_pass_in_order_both_ways() -> None:
    client, peer = _pair()
    left, right = socket.socketpair()
    with left, right:
        for i in range(3):
            p.send_message(left, p.Lookup([K1]), i, client)
            assert p.recv_message(right, session=peer) == (p.Lookup([K1]), i)
            p.send_message(right, p.LookupReply([True]), i, peer)
            assert p.recv_message(left, session=client) == (p.LookupReply([True]), i)


def _frames(session: Session, *messages: p.Message) -> list[bytes]:
    return [p.encode(m, i + 1, session) for i, m in enumerate(messages)]


def _check(session: Session, frame: bytes) -> p.Message:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(frame)
        return p.recv_message(right, session=session)[0]


@pytest.mark.parametrize("attack", ["altered", "injected", "replayed", "reflected", "dropped", "unsealed"])
def test_frames_changed_in_transit_fail_their_mac(attack: str) -> None:
    client, peer = _pair()
    first, second = _frames(client, p.Delete([K1]), p.Delete([K2]))
    if attack == "altered":  # one key swapped for another of the same length
        forged = first.replace(K1.encode(), K1[:-1].encode() + b"0")
        with pytest.raises(p.ProtocolError, match="session MAC"):
            _check(peer, forged)
    elif attack == "injected":  # a frame sealed under another session's key
        other = Session(b"x" * 32, client=True)
        with pytest.raises(p.ProtocolError, match="session MAC"):
            _check(peer, p.encode(p.Delete([K2]), 1, other))
    elif attack == "replayed":
        assert _check(peer, first) == p.Delete([K1])
        with pytest.raises(p.ProtocolError, match="session MAC"):
            _check(peer, first)
    elif attack == "reflected":  # the client's own frame sent back to it as if from the peer
        with pytest.raises(p.ProtocolError, match="session MAC"):
            _check(client, first)
    elif attack == "dropped":
        with pytest.raises(p.ProtocolError, match="session MAC"):
            _check(peer, second)
    else:
        with pytest.raises(p.ProtocolError, match="unsealed") as info:
            _check(peer, p.encode(p.Delete([K1]), 1))
        assert info.value.code == p.ErrorCode.AUTH_FAILED


def test_sealed_frame_before_the_handshake_is_malformed() -> None:
    client, _ = _pair()
    with pytest.raises(p.ProtocolError, match="sealed frame before"):
        p.decode_header(p.encode(p.Used(), 1, client)[: p.HEADER.size])


def _handshake(token: bytes, dialed: str, peer_dialed: str | None = None) -> tuple[Session, Session]:
    """Steps 1-4 in memory: ``(client session, peer session)``; ``peer_dialed``: the address
    a relay rewrote HELLO to."""
    opened: list[tuple[p.Hello, bytes]] = []
    sessions: list[Session] = []

    def exchange(message: p.Message) -> p.Message:
        if isinstance(message, p.Hello):
            hello = dataclasses.replace(message, dialed=peer_dialed or message.dialed)
            reply, nonce = challenge(token, hello)
            opened.append((hello, nonce))
            return reply
        assert isinstance(message, p.Prove)
        hello, nonce = opened[0]
        assert check_client(token, hello, nonce, message)
        welcome = p.HelloReply("peer-agent", b"meta", 0, 1, 1)
        welcome = dataclasses.replace(welcome, mac=welcome_mac(token, hello, nonce, welcome))
        sessions.append(peer_session(token, hello, nonce, welcome))
        return welcome

    _, session = client_handshake(exchange, token, "c", dialed)
    return session, sessions[0]


def test_the_handshake_binds_the_address_dialed() -> None:
    client, peer = _handshake(b"tok", "10.0.0.1:5555")
    assert _check(peer, p.encode(p.Used(), 1, client)) == p.Used()
    with pytest.raises(PeerAuthError, match=r"did not prove our token for 10\.0\.0\.1:5556"):
        _handshake(b"tok", "10.0.0.1:5556", peer_dialed="10.0.0.1:5555")


def test_names_this_peer() -> None:
    local = ("127.0.0.1", 5555)
    assert names_this_peer("127.0.0.1:5555", local)
    assert names_this_peer("localhost:5555", local)
    assert not names_this_peer("127.0.0.1:5556", local)  # another peer's port on this host
    assert not names_this_peer("10.255.255.1:5555", local)  # another host
    assert not names_this_peer("no-such-host.invalid:5555", local)
    assert not names_this_peer("garbage", local)
    assert names_this_peer("[::ffff:127.0.0.1]:5555", local)
    assert names_this_peer("gateway.example:80", local, frozenset({"gateway.example:80"}))
