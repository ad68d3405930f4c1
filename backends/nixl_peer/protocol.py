"""Control protocol between :class:`NixlPeerBackend` clients and a cache peer (binary, versioned).

Page bytes never travel here: they move with NIXL READ/WRITE between the peer's registered pool
and the client's staging buffer. This channel carries only keys, sizes, offsets and ids.

Frame: a 16-byte header ``!4sBBHII`` = magic ``b"HOPP"``, version, message type, flags,
request id, body length; then the body, read as it arrives (a declared length is never
allocated up front); then, on frames after the handshake (flag :data:`FLAG_SEALED`, required
there and refused before), the :data:`TAG_BYTES`-byte session MAC of :class:`.auth.Session`.
Bodies use the field codec of :mod:`.codec`. A body longer than :data:`MAX_BODY`
(:data:`MAX_HELLO_BODY` before HELLO), more than :data:`MAX_KEYS` items, an unknown type or
version, trailing bytes, a truncated field or a wrong tag raise :class:`ProtocolError` (the peer
answers :class:`Error` and closes that connection). Nothing is pickled or parsed as JSON.

Requests and their replies (reply type = request type | 0x80; any request may get
:class:`Error` instead):

=========  ==================================  =============================================
HELLO      client nonce, name, dialed address  CHALLENGE: peer nonce, peer proof
PROVE      client proof                        peer agent name, NIXL metadata, pool info, MAC
LOOKUP     keys                                present bitmap (no LRU refresh)
GET        keys                                lease id, per key (offset, length) or miss
RELEASE    lease id                            ack
ALLOC      keys, sizes                         alloc id, per key offset or refused
COMMIT     alloc id, per key success flags     committed count, evictions, evicted bytes
DELETE     keys                                how many existed
USED       -                                   used, reserved and free pool bytes, pages
SCAN       key prefix, after key, limit        up to limit (key, size, idle ms) in key order
                                               after ``after``, and whether more may follow
=========  ==================================  =============================================

The handshake (HELLO, PROVE) is :mod:`.auth`'s: the token never crosses the wire.

Versioning: :data:`VERSION` changes only when the framing or an existing body changes. New
request types are added without a bump (SCAN was): a peer that predates one answers
:class:`Error` (``MALFORMED``, "unknown message type") and closes the connection, which the
client reports as that peer lacking the feature.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import ClassVar, Protocol

from ..base import KEY_PATTERN, KEY_PREFIX_PATTERN
from .codec import (
    MAX_KEYS,
    U8,
    U16,
    U32,
    U64,
    ErrorCode,
    ProtocolError,
    Reader,
    blob16_field,
    flags_field,
    keys_field,
    u64s_field,
)

__all__ = [
    "FLAG_SEALED",
    "HEADER",
    "MAGIC",
    "MAX_BODY",
    "MAX_HELLO_BODY",
    "MAX_KEYS",
    "MISS",
    "SCAN_MAX_ENTRIES",
    "TAG_BYTES",
    "VERSION",
    "Alloc",
    "AllocReply",
    "Challenge",
    "Commit",
    "CommitReply",
    "Delete",
    "DeleteReply",
    "Error",
    "ErrorCode",
    "Get",
    "GetReply",
    "Hello",
    "HelloReply",
    "Lookup",
    "LookupReply",
    "Message",
    "ProtocolError",
    "Prove",
    "Release",
    "ReleaseReply",
    "Scan",
    "ScanReply",
    "Used",
    "UsedReply",
    "decode_body",
    "decode_header",
    "encode",
    "recv_message",
    "send_message",
]

MAGIC = b"HOPP"
VERSION = 3  # 2: the handshake proves the token instead of sending it; 3: bound to the
#: dialed address, later frames sealed
FLAG_SEALED = 0x1
TAG_BYTES = 16
HEADER = struct.Struct("!4sBBHII")  # magic, version, type, flags, request id, body length
MAX_BODY = 16 << 20
MISS = (1 << 64) - 1  # offset meaning "no such page" / "refused"
#: entries per SCAN reply at most (a reply then stays below ~2.5 MiB, far under MAX_BODY)
SCAN_MAX_ENTRIES = 16384
_REPLY = 0x80
#: the largest HELLO body (three 16-bit length-prefixed fields): all a peer reads before the
#: handshake is done (PROVE is smaller)
MAX_HELLO_BODY = 3 * (2 + 0xFFFF)

# -- messages ---------------------------------------------------------------------------------


class Message:
    """Base of all messages: ``TYPE`` is the wire type, ``body()`` / ``parse()`` the codec."""

    TYPE: ClassVar[int]

    def body(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def parse(cls, reader: Reader) -> Message:
        raise NotImplementedError


@dataclass(frozen=True)
class Hello(Message):
    """Opens the handshake (:mod:`.auth`): the client's nonce (never its token) and the
    ``host:port`` it dialed."""

    TYPE: ClassVar[int] = 1
    nonce: bytes
    client_name: str
    dialed: str

    def body(self) -> bytes:
        name, dialed = self.client_name.encode(), self.dialed.encode()
        return blob16_field(self.nonce) + blob16_field(name) + blob16_field(dialed)

    @classmethod
    def parse(cls, reader: Reader) -> Hello:
        return cls(reader.blob16(), reader.text16(), reader.text16())


@dataclass(frozen=True)
class Challenge(Message):
    """The peer's nonce and its proof that it holds the token."""

    TYPE: ClassVar[int] = 1 | _REPLY
    nonce: bytes
    proof: bytes

    def body(self) -> bytes:
        return blob16_field(self.nonce) + blob16_field(self.proof)

    @classmethod
    def parse(cls, reader: Reader) -> Challenge:
        return cls(reader.blob16(), reader.blob16())


@dataclass(frozen=True)
class Prove(Message):
    """The client's proof that it holds the token."""

    TYPE: ClassVar[int] = 10
    proof: bytes

    def body(self) -> bytes:
        return blob16_field(self.proof)

    @classmethod
    def parse(cls, reader: Reader) -> Prove:
        return cls(reader.blob16())


@dataclass(frozen=True)
class HelloReply(Message):
    """What a client needs from its peer, after both proved the token; ``mac`` binds these
    fields to the handshake (:func:`.auth.welcome_mac`)."""

    TYPE: ClassVar[int] = 10 | _REPLY
    agent_name: str
    metadata: bytes
    pool_base: int
    pool_size: int
    capacity: int
    mac: bytes = b""

    def fields(self) -> bytes:
        """The body without the MAC: what the MAC covers."""
        meta = U32.pack(len(self.metadata)) + self.metadata
        nums = u64s_field([self.pool_base, self.pool_size, self.capacity])
        return blob16_field(self.agent_name.encode()) + meta + nums

    def body(self) -> bytes:
        return self.fields() + blob16_field(self.mac)

    @classmethod
    def parse(cls, reader: Reader) -> HelloReply:
        name, metadata = reader.text16(), reader.blob32()
        return cls(name, metadata, reader.u64(), reader.u64(), reader.u64(), reader.blob16())


@dataclass(frozen=True)
class _KeysMessage(Message):
    keys: list[str]

    def body(self) -> bytes:
        return keys_field(self.keys)

    @classmethod
    def parse(cls, reader: Reader) -> _KeysMessage:
        return cls(reader.keys())


@dataclass(frozen=True)
class Lookup(_KeysMessage):
    TYPE: ClassVar[int] = 2


@dataclass(frozen=True)
class LookupReply(Message):
    TYPE: ClassVar[int] = 2 | _REPLY
    present: list[bool]

    def body(self) -> bytes:
        return U32.pack(len(self.present)) + flags_field(self.present)

    @classmethod
    def parse(cls, reader: Reader) -> LookupReply:
        return cls(reader.flags(reader.count()))


@dataclass(frozen=True)
class Get(_KeysMessage):
    TYPE: ClassVar[int] = 3


@dataclass(frozen=True)
class GetReply(Message):
    """``extents[i]`` is ``(offset, length)`` in the pool, or None for a miss."""

    TYPE: ClassVar[int] = 3 | _REPLY
    lease_id: int
    extents: list[tuple[int, int] | None]

    def body(self) -> bytes:
        offsets = [MISS if e is None else e[0] for e in self.extents]
        lengths = [0 if e is None else e[1] for e in self.extents]
        return U64.pack(self.lease_id) + U32.pack(len(offsets)) + u64s_field(offsets) + u64s_field(lengths)

    @classmethod
    def parse(cls, reader: Reader) -> GetReply:
        lease_id = reader.u64()
        n = reader.count()
        offsets, lengths = reader.u64s(n), reader.u64s(n)
        extents = [None if o == MISS else (o, n) for o, n in zip(offsets, lengths, strict=True)]
        return cls(lease_id, extents)


@dataclass(frozen=True)
class Release(Message):
    TYPE: ClassVar[int] = 4
    lease_id: int

    def body(self) -> bytes:
        return U64.pack(self.lease_id)

    @classmethod
    def parse(cls, reader: Reader) -> Release:
        return cls(reader.u64())


@dataclass(frozen=True)
class ReleaseReply(Message):
    TYPE: ClassVar[int] = 4 | _REPLY
    released: bool

    def body(self) -> bytes:
        return U8.pack(int(self.released))

    @classmethod
    def parse(cls, reader: Reader) -> ReleaseReply:
        return cls(bool(reader.u8()))


@dataclass(frozen=True)
class Alloc(Message):
    TYPE: ClassVar[int] = 5
    keys: list[str]
    sizes: list[int]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.sizes):
            raise ProtocolError(ErrorCode.MALFORMED, "ALLOC: keys and sizes differ in count")

    def body(self) -> bytes:
        return keys_field(self.keys) + u64s_field(self.sizes)

    @classmethod
    def parse(cls, reader: Reader) -> Alloc:
        keys = reader.keys()
        return cls(keys, reader.u64s(len(keys)))


@dataclass(frozen=True)
class AllocReply(Message):
    """``offsets[i]`` is the reserved pool offset for key i, or None if refused."""

    TYPE: ClassVar[int] = 5 | _REPLY
    alloc_id: int
    offsets: list[int | None]

    def body(self) -> bytes:
        raw = [MISS if o is None else o for o in self.offsets]
        return U64.pack(self.alloc_id) + U32.pack(len(raw)) + u64s_field(raw)

    @classmethod
    def parse(cls, reader: Reader) -> AllocReply:
        alloc_id = reader.u64()
        raw = reader.u64s(reader.count())
        return cls(alloc_id, [None if o == MISS else o for o in raw])


@dataclass(frozen=True)
class Commit(Message):
    TYPE: ClassVar[int] = 6
    alloc_id: int
    success: list[bool]

    def body(self) -> bytes:
        return U64.pack(self.alloc_id) + U32.pack(len(self.success)) + flags_field(self.success)

    @classmethod
    def parse(cls, reader: Reader) -> Commit:
        alloc_id = reader.u64()
        return cls(alloc_id, reader.flags(reader.count()))


@dataclass(frozen=True)
class CommitReply(Message):
    TYPE: ClassVar[int] = 6 | _REPLY
    committed: int
    evictions: int
    evicted_bytes: int

    def body(self) -> bytes:
        return u64s_field([self.committed, self.evictions, self.evicted_bytes])

    @classmethod
    def parse(cls, reader: Reader) -> CommitReply:
        return cls(reader.u64(), reader.u64(), reader.u64())


@dataclass(frozen=True)
class Delete(_KeysMessage):
    TYPE: ClassVar[int] = 7


@dataclass(frozen=True)
class DeleteReply(Message):
    TYPE: ClassVar[int] = 7 | _REPLY
    deleted: int

    def body(self) -> bytes:
        return U64.pack(self.deleted)

    @classmethod
    def parse(cls, reader: Reader) -> DeleteReply:
        return cls(reader.u64())


@dataclass(frozen=True)
class Used(Message):
    TYPE: ClassVar[int] = 8

    def body(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, reader: Reader) -> Used:
        return cls()


@dataclass(frozen=True)
class UsedReply(Message):
    """``used``: visible page bytes; ``reserved``: pool bytes held by open ALLOCs;
    ``free``: pool bytes not held by anything; ``pages``: visible pages."""

    TYPE: ClassVar[int] = 8 | _REPLY
    used: int
    reserved: int
    free: int
    pages: int

    def body(self) -> bytes:
        return u64s_field([self.used, self.reserved, self.free, self.pages])

    @classmethod
    def parse(cls, reader: Reader) -> UsedReply:
        return cls(reader.u64(), reader.u64(), reader.u64(), reader.u64())


@dataclass(frozen=True)
class Scan(Message):
    """List pages whose key starts with ``prefix`` and sorts after ``after`` ("" = from the
    start), in key order, at most ``limit`` (the peer caps it at :data:`SCAN_MAX_ENTRIES`)."""

    TYPE: ClassVar[int] = 9
    prefix: str
    after: str
    limit: int

    def body(self) -> bytes:
        prefix, after = self.prefix.encode("ascii"), self.after.encode("ascii")
        return blob16_field(prefix) + blob16_field(after) + U32.pack(self.limit)

    @classmethod
    def parse(cls, reader: Reader) -> Scan:
        prefix = reader.blob16().decode("ascii", errors="replace")
        after = reader.blob16().decode("ascii", errors="replace")
        if KEY_PREFIX_PATTERN.fullmatch(prefix) is None:
            raise ProtocolError(ErrorCode.MALFORMED, f"SCAN: invalid key prefix {prefix[:80]!r}")
        if after and KEY_PATTERN.fullmatch(after) is None:
            raise ProtocolError(ErrorCode.MALFORMED, f"SCAN: invalid key {after[:80]!r}")
        return cls(prefix, after, reader.u32())


@dataclass(frozen=True)
class ScanReply(Message):
    """``entries``: ``(key, size, idle_ms)`` in key order, ``idle_ms`` the milliseconds since the
    page's last commit or GET on the peer; ``more``: whether keys after the last may match."""

    TYPE: ClassVar[int] = 9 | _REPLY
    entries: list[tuple[str, int, int]]
    more: bool

    def body(self) -> bytes:
        keys = [key for key, _, _ in self.entries]
        sizes = [size for _, size, _ in self.entries]
        idles = [idle for _, _, idle in self.entries]
        return U8.pack(int(self.more)) + keys_field(keys) + u64s_field(sizes) + u64s_field(idles)

    @classmethod
    def parse(cls, reader: Reader) -> ScanReply:
        more = bool(reader.u8())
        keys = reader.keys()
        sizes, idles = reader.u64s(len(keys)), reader.u64s(len(keys))
        return cls(list(zip(keys, sizes, idles, strict=True)), more)


@dataclass(frozen=True)
class Error(Message):
    TYPE: ClassVar[int] = 0xFF
    code: int
    message: str

    def body(self) -> bytes:
        return U16.pack(self.code) + blob16_field(self.message.encode()[:4000])

    @classmethod
    def parse(cls, reader: Reader) -> Error:
        return cls(reader.u16(), reader.text16())


_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello, Challenge, Prove, HelloReply, Lookup, LookupReply, Get, GetReply, Release, ReleaseReply, Alloc,
        AllocReply, Commit, CommitReply, Delete, DeleteReply, Used, UsedReply, Scan, ScanReply,
        Error,
    )
}  # fmt: skip


# -- framing ----------------------------------------------------------------------------------


class Sealer(Protocol):
    """What frames after the handshake are sealed and checked with (:class:`.auth.Session`)."""

    def seal(self, header: bytes, body: bytes) -> bytes: ...

    def check(self, header: bytes, body: bytes, tag: bytes) -> None: ...


def encode(message: Message, request_id: int, session: Sealer | None = None) -> bytes:
    """One frame: header + body (+ tag with ``session``). Raises ValueError if the body
    exceeds :data:`MAX_BODY`."""
    body = message.body()
    if len(body) > MAX_BODY:
        raise ValueError(f"{type(message).__name__} body of {len(body)} bytes exceeds {MAX_BODY}")
    flags = 0 if session is None else FLAG_SEALED
    header = HEADER.pack(MAGIC, VERSION, message.TYPE, flags, request_id & 0xFFFFFFFF, len(body))
    return header + body + (b"" if session is None else session.seal(header, body))


def decode_header(header: bytes, max_body: int = MAX_BODY, *, sealed: bool = False) -> tuple[int, int, int]:
    """``(type, request_id, body_length)`` of a 16-byte header; ProtocolError if invalid, if
    its seal flag is not ``sealed`` or if the body declared is longer than ``max_body``."""
    if len(header) != HEADER.size:
        raise ProtocolError(ErrorCode.MALFORMED, "truncated header")
    magic, version, msg_type, flags, request_id, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.MALFORMED, f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION, f"protocol version {version} (want {VERSION})"
        )
    if msg_type not in _TYPES:
        raise ProtocolError(ErrorCode.MALFORMED, f"unknown message type {msg_type}")
    if flags & ~FLAG_SEALED:
        raise ProtocolError(ErrorCode.MALFORMED, f"unknown flags {flags:#x}")
    if bool(flags & FLAG_SEALED) != sealed:
        what = "an unsealed frame after the handshake" if sealed else "a sealed frame before the handshake"
        raise ProtocolError(ErrorCode.AUTH_FAILED if sealed else ErrorCode.MALFORMED, what)
    if length > max_body:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"body of {length} bytes exceeds {max_body}")
    return msg_type, request_id, length


def decode_body(msg_type: int, body: bytes) -> Message:
    """Parse a body of a known type; the whole body must be consumed."""
    cls = _TYPES.get(msg_type)
    if cls is None:
        raise ProtocolError(ErrorCode.MALFORMED, f"unknown message type {msg_type}")
    reader = Reader(body)
    message = cls.parse(reader)
    reader.done()
    return message


_RECV_CHUNK = 256 << 10


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes; memory grows with the bytes received, never with ``n`` up front (a peer
    that declares a large body and sends nothing costs at most one chunk)."""
    if n <= _RECV_CHUNK:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            chunk = sock.recv_into(view[got:], n - got)
            if chunk == 0:
                raise ConnectionError("connection closed by the other side")
            got += chunk
        return bytes(buf)
    parts = bytearray()
    while len(parts) < n:
        data = sock.recv(min(_RECV_CHUNK, n - len(parts)))
        if not data:
            raise ConnectionError("connection closed by the other side")
        parts += data
    return bytes(parts)


def recv_message(
    sock: socket.socket, max_body: int = MAX_BODY, session: Sealer | None = None
) -> tuple[Message, int]:
    """Read one frame from ``sock``: ``(message, request_id)``; a declared body longer than
    ``max_body`` raises ProtocolError (``TOO_LARGE``) before any of it is read. With a
    ``session`` the frame must be sealed and its tag is checked before the body is parsed.

    Raises ProtocolError for a malformed frame or a wrong tag, ConnectionError / OSError /
    socket.timeout when the connection fails.
    """
    header = _recv_exact(sock, HEADER.size)
    msg_type, request_id, length = decode_header(header, max_body, sealed=session is not None)
    body = _recv_exact(sock, length) if length else b""
    if session is not None:
        session.check(header, body, _recv_exact(sock, TAG_BYTES))
    return decode_body(msg_type, body), request_id


def send_message(
    sock: socket.socket, message: Message, request_id: int, session: Sealer | None = None
) -> None:
    sock.sendall(encode(message, request_id, session))
