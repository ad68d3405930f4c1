"""Body codec of the nixl_peer control protocol (:mod:`.protocol`): error codes, the
bounds-checked :class:`Reader` and the field writers. Fixed-width big-endian ints and
length-prefixed byte strings; keys are ``u32 count`` then per key ``u8 length`` + ASCII,
checked against :data:`~hybrid_offload.backends.base.KEY_PATTERN`. Every short or invalid field
raises :class:`ProtocolError`; a count above :data:`MAX_KEYS` raises it with ``TOO_LARGE``
before anything is parsed, so one message costs the peer bounded time under its lock.
"""

from __future__ import annotations

import struct
from enum import IntEnum

from ..base import KEY_PATTERN

__all__ = ["MAX_KEYS", "ErrorCode", "ProtocolError", "Reader"]

#: items (keys, flags, offsets) per message at most: twice what a client sends per request
MAX_KEYS = 16384

U8 = struct.Struct("!B")
U16 = struct.Struct("!H")
U32 = struct.Struct("!I")
U64 = struct.Struct("!Q")


class ErrorCode(IntEnum):
    MALFORMED = 1
    UNSUPPORTED_VERSION = 2
    TOO_LARGE = 3
    AUTH_FAILED = 4
    HELLO_REQUIRED = 5
    UNKNOWN_LEASE = 6
    UNKNOWN_ALLOC = 7
    INTERNAL = 8
    BUSY = 9  # too many connections, or too many open ids on this one
    NOT_THIS_PEER = 10  # HELLO names an address this peer does not answer to


class ProtocolError(Exception):
    """A frame or body is malformed; ``code`` is the :class:`ErrorCode` to answer with."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Reader:
    """Bounds-checked cursor over a body; every short read raises ProtocolError."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._pos = 0

    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if n < 0 or end > len(self._data):
            raise ProtocolError(ErrorCode.MALFORMED, "truncated message body")
        chunk = self._data[self._pos : end]
        self._pos = end
        return chunk

    def u8(self) -> int:
        return int(U8.unpack(self._take(1))[0])

    def u16(self) -> int:
        return int(U16.unpack(self._take(2))[0])

    def u32(self) -> int:
        return int(U32.unpack(self._take(4))[0])

    def u64(self) -> int:
        return int(U64.unpack(self._take(8))[0])

    def u64s(self, n: int) -> list[int]:
        return list(struct.unpack(f"!{n}Q", self._take(8 * n)))

    def blob16(self) -> bytes:
        return bytes(self._take(self.u16()))

    def blob32(self) -> bytes:
        return bytes(self._take(self.u32()))

    def text16(self) -> str:
        try:
            return self.blob16().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(ErrorCode.MALFORMED, "text field is not UTF-8") from exc

    def count(self) -> int:
        n = self.u32()
        if n > MAX_KEYS:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{n} items in one message (max {MAX_KEYS})")
        return n

    def keys(self) -> list[str]:
        keys = []
        for _ in range(self.count()):
            raw = bytes(self._take(self.u8()))
            text = raw.decode("ascii", errors="replace")
            if KEY_PATTERN.fullmatch(text) is None:
                raise ProtocolError(ErrorCode.MALFORMED, f"invalid page key {raw[:80]!r}")
            keys.append(text)
        return keys

    def flags(self, n: int) -> list[bool]:
        bits = self._take((n + 7) // 8)
        return [bool(bits[i >> 3] & (1 << (i & 7))) for i in range(n)]

    def done(self) -> None:
        if self._pos != len(self._data):
            raise ProtocolError(ErrorCode.MALFORMED, "trailing bytes after message body")


def keys_field(keys: list[str]) -> bytes:
    parts = [U32.pack(len(keys))]
    for key in keys:
        raw = key.encode("ascii")
        parts.append(U8.pack(len(raw)) + raw)
    return b"".join(parts)


def blob16_field(data: bytes) -> bytes:
    if len(data) > 0xFFFF:
        raise ValueError("field longer than 65535 bytes")
    return U16.pack(len(data)) + data


def flags_field(values: list[bool]) -> bytes:
    bits = bytearray((len(values) + 7) // 8)
    for i, value in enumerate(values):
        if value:
            bits[i >> 3] |= 1 << (i & 7)
    return bytes(bits)


def u64s_field(values: list[int]) -> bytes:
    return struct.pack(f"!{len(values)}Q", *values)
