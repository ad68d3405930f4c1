"""nixl_peer control protocol: every message round-trips; malformed input is rejected."""

from __future__ import annotations

import socket
import struct

import pytest

from hybrid_offload.backends.nixl_peer import protocol as p

K1 = "5eed0001-" + "ab" * 16
K2 = "0123abcd-" + "0" * 64

MESSAGES: list[p.Message] = [
    p.Hello(b"n" * 32, "client-1"),
    p.Hello(b"", ""),
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
