"""Canonical page format: a fixed, self-describing, checksummed header plus a payload.

Every backend stores these exact bytes. The payload layout depends only on the group's
logical tensors (see ``GroupSpec.page_tensors``): attention K then V per layer in
``[token][head][dim]`` order, Mamba/GDN states per layer without vLLM's page padding. It does
not depend on kernel block size, padding or device, so identical content gives byte-identical
pages in every process and across restarts.

Layout (little-endian)::

    fixed header  (struct _FIXED; the chunk hash is 32 bytes, the MAC 32 zero bytes unless signed)
    tensor table  n_tensors x (dtype code u8, ndim u8, dims u32 x ndim)
    zero padding  so that the header is a multiple of 64 bytes
    header xxh3-64 over everything above (the last 8 header bytes)
    payload       payload_len bytes, checksummed with fold64 (``core.checksum``) in the fixed header

The payload checksum is :func:`~hybrid_offload.core.checksum.fold64`, which a GPU computes with
two kernels and numpy without the GIL: a GPU engine checks the header here (:func:`check_header`,
:func:`check_headers`) and the payload on the device after the copy. The checksums catch
corruption, not forgery. Where a cache has a secret key (shared tiers that
others can write), pages are signed: the MAC field holds HMAC-SHA256 under the key over the
header (MAC zeroed, without the header checksum) and the payload, and a reader with the key
refuses unsigned or badly signed pages.

Decoding never trusts sizes before checking them against hard bounds, so a hostile page
cannot make the decoder allocate without limit. No pickle, no torch.load.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import numpy as np
import xxhash

from hybrid_offload import FORMAT_VERSION
from hybrid_offload.core.checksum import fold64
from hybrid_offload.core.layer_parts import LAYERS_DIGEST_LEN as LAYERS_LEN
from hybrid_offload.core.spec import DTYPE_SIZES, GroupKind, TensorSpec

MAGIC = b"HOPG"
MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 8192
MAX_NDIM = 8
MAX_PAYLOAD_BYTES = 1 << 34
HEADER_ALIGN = 64

_DTYPE_CODES = {name: i + 1 for i, name in enumerate(sorted(DTYPE_SIZES))}
_CODE_DTYPES = {code: name for name, code in _DTYPE_CODES.items()}
_KIND_CODES = {GroupKind.FULL_ATTENTION: 1, GroupKind.SLIDING_WINDOW: 2, GroupKind.MAMBA: 3}
_CODE_KINDS = {code: kind for kind, code in _KIND_CODES.items()}

#: the fixed header's fields and their struct codes, in order
_FIELDS = (("magic", "4s"), ("version", "H"), ("hlen", "I"), ("fingerprint", "16s"), ("chunk_hash", "32s"),
           ("group", "H"), ("kind", "B"), ("shard", "H"), ("shards", "H"), ("layer_start", "H"),
           ("layer_end", "H"), ("layers", "16s"), ("chunk_index", "I"), ("num_tokens", "I"),
           ("n_tensors", "H"), ("plen", "Q"), ("payload_checksum", "Q"), ("mac", "32s"))  # fmt: skip
_FIXED = struct.Struct("<" + "".join(code for _, code in _FIELDS))
MAC_LEN = 32
FINGERPRINT_LEN = 16
CHUNK_HASH_LEN = 32
_MAC_OFFSET = _FIXED.size - MAC_LEN
_NO_MAC = bytes(MAC_LEN)
_CHECKSUM = struct.Struct("<Q")


class PageFormatError(ValueError):
    """The bytes are not a valid page, or not the page that was asked for."""


class ForeignLayersError(PageFormatError):
    """A valid page of the set asked for, whose layer part holds other layers: written by an
    engine whose vLLM groups the model's layers otherwise (a miss, not a corrupt page)."""


@dataclass(frozen=True)
class PageHeader:
    """Everything the header says about a page.

    ``shard`` of ``shards``: which tensor-parallel-portable piece of its (chunk, group) page set
    the page holds (see ``hybrid_offload.core.tp_shards``); 0 of 1 when the set is one page.
    ``[layer_start, layer_end)``: the layer part's decoder layers
    (``hybrid_offload.core.layer_parts``), and ``layers``
    the digest of its layer names.
    ``signed``: (decoded pages) the page carries a MAC; whether it verifies is checked by
    :func:`decode_page` with the key.
    """

    fingerprint: bytes
    chunk_hash: bytes
    group_index: int
    kind: GroupKind
    chunk_index: int
    num_tokens: int
    tensors: tuple[TensorSpec, ...]
    shard: int = 0
    shards: int = 1
    layer_start: int = 0
    layer_end: int = 0
    layers: bytes = bytes(LAYERS_LEN)
    signed: bool = False

    @property
    def payload_len(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _tensor_table(tensors: tuple[TensorSpec, ...]) -> bytes:
    parts = []
    for t in tensors:
        parts.append(struct.pack("<BB", _DTYPE_CODES[t.dtype], len(t.shape)))
        parts.append(struct.pack(f"<{len(t.shape)}I", *t.shape))
    return b"".join(parts)


def header_len(tensors: tuple[TensorSpec, ...]) -> int:
    """Bytes before the payload: padded to a multiple of 64 so payload tensors are aligned."""
    table = sum(2 + 4 * len(t.shape) for t in tensors)
    return -(-(_FIXED.size + table + _CHECKSUM.size) // HEADER_ALIGN) * HEADER_ALIGN


def page_len(tensors: tuple[TensorSpec, ...]) -> int:
    return header_len(tensors) + sum(t.nbytes for t in tensors)


def _mac(key: bytes, header: bytes | bytearray | memoryview, payload: memoryview) -> bytes:
    """HMAC-SHA256 over ``header`` (its MAC field zero, no header checksum) and ``payload``."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    h.update(header)
    h.update(payload)
    return h.digest()


def seal_page(
    buf: bytearray | memoryview,
    header: PageHeader,
    key: bytes | None = None,
    payload_checksum: int | None = None,
) -> None:
    """Write the header into ``buf`` whose payload region (after ``header_len``) is filled,
    signed under ``key`` where one is given; ``payload_checksum``: the payload's fold64 where
    the caller computed it (on the device), else it is computed here.

    ``buf`` must be exactly ``page_len(header.tensors)`` bytes. The payload is not copied.
    """
    view = memoryview(buf).cast("B")
    hlen = header_len(header.tensors)
    plen = header.payload_len
    if (len(header.fingerprint), len(header.chunk_hash), len(header.layers)) != (
        FINGERPRINT_LEN, CHUNK_HASH_LEN, LAYERS_LEN
    ):
        raise PageFormatError(
            f"fingerprint, chunk hash and layers must be {FINGERPRINT_LEN}, {CHUNK_HASH_LEN} and "
            f"{LAYERS_LEN} bytes, got {len(header.fingerprint)}, {len(header.chunk_hash)} and "
            f"{len(header.layers)}"
        )
    if len(view) != hlen + plen:
        raise PageFormatError(f"page buffer is {len(view)} bytes, expected {hlen + plen}")
    if payload_checksum is None:
        payload_checksum = fold64(view[hlen:])
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, hlen, header.fingerprint, header.chunk_hash,
        header.group_index, _KIND_CODES[header.kind], header.shard, header.shards, header.layer_start,
        header.layer_end, header.layers, header.chunk_index, header.num_tokens, len(header.tensors), plen,
        payload_checksum,
        _NO_MAC,
    )
    table = _tensor_table(header.tensors)
    end = _FIXED.size + len(table)
    view[: _FIXED.size] = fixed
    view[_FIXED.size : end] = table
    view[end : hlen - _CHECKSUM.size] = bytes(hlen - _CHECKSUM.size - end)
    if key:
        view[_MAC_OFFSET:_FIXED.size] = _mac(key, view[: hlen - _CHECKSUM.size], view[hlen:])
    view[hlen - _CHECKSUM.size : hlen] = _CHECKSUM.pack(
        xxhash.xxh3_64_intdigest(view[: hlen - _CHECKSUM.size])
    )


def encode_page(header: PageHeader, payload: bytes | memoryview, key: bytes | None = None) -> bytes:
    """Convenience: header + a payload given as one buffer."""
    hlen = header_len(header.tensors)
    buf = bytearray(hlen + len(payload))
    buf[hlen:] = payload
    seal_page(buf, header, key)
    return bytes(buf)


def _parse_table(view: memoryview, offset: int, n_tensors: int, hlen: int) -> tuple[TensorSpec, ...]:
    tensors = []
    for i in range(n_tensors):
        if offset + 2 > hlen:
            raise PageFormatError("tensor table runs past the header")
        code, ndim = struct.unpack_from("<BB", view, offset)
        offset += 2
        if code not in _CODE_DTYPES or ndim > MAX_NDIM or offset + 4 * ndim > hlen:
            raise PageFormatError(f"tensor {i}: bad dtype code {code} or ndim {ndim}")
        shape = struct.unpack_from(f"<{ndim}I", view, offset)
        offset += 4 * ndim
        tensors.append(TensorSpec(f"t{i}", tuple(shape), _CODE_DTYPES[code]))
    if header_len(tuple(tensors)) != hlen:
        raise PageFormatError("header length does not match its tensor table")
    return tuple(tensors)


def decode_header(data: bytes | bytearray | memoryview) -> tuple[PageHeader, int, int]:
    """Parse and verify the header; return it, the payload offset and the payload checksum.

    The payload itself is not checked here."""
    view = memoryview(data).cast("B")
    if len(view) < _FIXED.size + _CHECKSUM.size:
        raise PageFormatError(f"page too short ({len(view)} bytes)")
    (magic, version, hlen, fingerprint, chunk_hash, group, kind, shard, shards, part, parts, layers,
     chunk_index, num_tokens, n_tensors, plen, payload_checksum, mac) = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise PageFormatError("bad magic: not a hybrid-offload page")
    if version != FORMAT_VERSION:
        raise PageFormatError(f"page format version {version}, expected {FORMAT_VERSION}")
    if not (_FIXED.size + _CHECKSUM.size <= hlen <= min(MAX_HEADER_BYTES, len(view))):
        raise PageFormatError(f"bad header length {hlen}")
    if n_tensors > MAX_TENSORS or kind not in _CODE_KINDS or plen > MAX_PAYLOAD_BYTES or not (
        0 <= shard < shards and 0 <= part <= parts
    ):
        raise PageFormatError("header fields out of range")
    (stored,) = _CHECKSUM.unpack_from(view, hlen - _CHECKSUM.size)
    if xxhash.xxh3_64_intdigest(view[: hlen - _CHECKSUM.size]) != stored:
        raise PageFormatError("header checksum mismatch")
    tensors = _parse_table(view, _FIXED.size, n_tensors, hlen)
    if sum(prod(t.shape) * DTYPE_SIZES[t.dtype] for t in tensors) != plen:
        raise PageFormatError("tensor table does not add up to the payload length")
    header = PageHeader(fingerprint, chunk_hash, group, _CODE_KINDS[kind], chunk_index,
                        num_tokens, tensors, shard, shards, part, parts, layers, signed=mac != _NO_MAC)
    return header, hlen, payload_checksum


def decode_page(
    data: bytes | bytearray | memoryview, expected: PageHeader | None = None, key: bytes | None = None
) -> tuple[PageHeader, memoryview]:
    """Verify a whole page and return its header and payload (a view into ``data``).

    With ``expected``, every identifying field and the tensor shapes/dtypes must match it,
    so a valid page stored under the wrong key is rejected too. With ``key``, the page must be
    signed under it (a page without a valid MAC is refused).
    """
    view = memoryview(data).cast("B")
    header, hlen, payload_checksum = decode_header(view)
    if len(view) != hlen + header.payload_len:
        raise PageFormatError(f"page is {len(view)} bytes, header says {hlen + header.payload_len}")
    payload = view[hlen:]
    if fold64(payload) != payload_checksum:
        raise PageFormatError("payload checksum mismatch")
    if key:
        _check_mac(view, hlen, payload, key)
    if expected is not None:
        _check_expected(header, expected)
    return header, payload


@dataclass(frozen=True)
class PageTemplate:
    """What every page of one (model, group, part, shard, chunk size) shares, encoded once, so that
    :func:`verify_page` checks a page with a few comparisons instead of decoding its header."""

    fingerprint: bytes
    group_index: int
    kind: GroupKind
    num_tokens: int
    shard: int
    shards: int
    layer_start: int
    layer_end: int
    layers: bytes
    hlen: int
    plen: int
    n_tensors: int
    table: bytes  # the tensor table as encoded after the fixed header

    @classmethod
    def of(cls, header: PageHeader) -> PageTemplate:
        """The template of ``header`` (its chunk hash and index are the per-page parts)."""
        tensors = header.tensors
        return cls(header.fingerprint, header.group_index, header.kind, header.num_tokens, header.shard,
                   header.shards, header.layer_start, header.layer_end, header.layers, header_len(tensors),
                   header.payload_len, len(tensors),
                   _tensor_table(tensors))  # fmt: skip


def _fixed_fields(view: memoryview, template: PageTemplate) -> tuple[tuple, int]:
    """Check what ``view`` shares with every page of ``template`` (length, magic, version, header
    checksum, tensor table); return its identity fields (as :data:`_IDENTITY`) and its payload
    checksum."""
    if len(view) != template.hlen + template.plen:
        raise PageFormatError(
            f"page is {len(view)} bytes, expected {template.hlen + template.plen} (truncated, or "
            "its tensor shapes/dtypes differ from the model's)"
        )
    (magic, version, hlen, fingerprint, got_hash, group, kind, shard, shards, part, parts, layers,
     got_index, num_tokens, n_tensors, plen, payload_checksum, _) = _FIXED.unpack_from(view, 0)  # fmt: skip
    if magic != MAGIC:
        raise PageFormatError("bad magic: not a hybrid-offload page")
    if version != FORMAT_VERSION:
        raise PageFormatError(f"page format version {version}, expected {FORMAT_VERSION}")
    (stored,) = _CHECKSUM.unpack_from(view, template.hlen - _CHECKSUM.size)
    if hlen != template.hlen or xxhash.xxh3_64_intdigest(view[: hlen - _CHECKSUM.size]) != stored:
        raise PageFormatError("header checksum mismatch")
    table = view[_FIXED.size : _FIXED.size + len(template.table)]
    if plen != template.plen or n_tensors != template.n_tensors or table != template.table:
        raise PageFormatError("page tensor shapes/dtypes differ from the model's")
    got = (fingerprint, got_hash, group, _CODE_KINDS.get(kind), got_index, num_tokens, shard, shards,
           part, parts, layers)  # fmt: skip
    return got, payload_checksum


def _check_identity(got: tuple, template: PageTemplate, chunk_hash: bytes, chunk_index: int) -> None:
    want = (template.fingerprint, chunk_hash, template.group_index, template.kind, chunk_index,
            template.num_tokens, template.shard, template.shards, template.layer_start, template.layer_end,
            template.layers)  # fmt: skip
    if got != want:
        for name, g, w in zip(_IDENTITY, got, want, strict=True):
            if g != w:
                error = ForeignLayersError if got[:-1] == want[:-1] else PageFormatError
                raise error(f"page {name} is {g!r}, expected {w!r}")


def verify_page(
    data: bytes | bytearray | memoryview, template: PageTemplate, chunk_hash: bytes, chunk_index: int,
    key: bytes | None = None,
) -> memoryview:  # fmt: skip
    """:func:`decode_page` against an expected header of ``template`` for chunk ``chunk_hash`` /
    ``chunk_index``, without decoding the header: the same bytes are accepted and refused (with
    the same kind of message); returns the payload (a view into ``data``)."""
    view = memoryview(data).cast("B")
    got, payload_checksum = _fixed_fields(view, template)
    payload = view[template.hlen :]
    if fold64(payload) != payload_checksum:
        raise PageFormatError("payload checksum mismatch")
    if key:
        _check_mac(view, template.hlen, payload, key)
    _check_identity(got, template, chunk_hash, chunk_index)
    return payload


def check_header(
    data: bytes | bytearray | memoryview, template: PageTemplate, chunk_hash: bytes, chunk_index: int
) -> int:
    """:func:`verify_page` without the payload's checksum and MAC: the page's header is the one
    asked for (same errors); returns the payload checksum it states, for whoever checks the
    payload where it is (:func:`fold64` on the device)."""
    view = memoryview(data).cast("B")
    got, payload_checksum = _fixed_fields(view, template)
    _check_identity(got, template, chunk_hash, chunk_index)
    return payload_checksum


def check_mac(data: bytes | bytearray | memoryview, template: PageTemplate, key: bytes) -> None:
    """Raise :class:`PageFormatError` unless the page (of ``template``, header checked) is
    signed under ``key``; what :func:`verify_page` checks with a key, on its own."""
    view = memoryview(data).cast("B")
    _check_mac(view, template.hlen, view[template.hlen :], key)


def _field(name: str) -> slice:
    """The bytes of fixed-header field ``name``."""
    names = [n for n, _ in _FIELDS]
    start = struct.calcsize("<" + "".join(code for _, code in _FIELDS[: names.index(name)]))
    return slice(start, start + struct.calcsize("<" + dict(_FIELDS)[name]))


_HASH, _INDEX, _PAYLOAD_SUM, _MAC = map(_field, ("chunk_hash", "chunk_index", "payload_checksum", "mac"))


def _expected_header(template: PageTemplate) -> np.ndarray:
    """The header bytes before its checksum that every page of ``template`` has, with zeros where
    pages differ (chunk hash and index, payload checksum, MAC)."""
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, template.hlen, template.fingerprint, bytes(CHUNK_HASH_LEN),
                        template.group_index, _KIND_CODES[template.kind], template.shard, template.shards,
                        template.layer_start, template.layer_end, template.layers, 0, template.num_tokens,
                        template.n_tensors, template.plen, 0, _NO_MAC)  # fmt: skip
    head = fixed + template.table
    head += bytes(template.hlen - _CHECKSUM.size - len(head))
    return np.frombuffer(head, dtype=np.uint8)


def seal_headers(
    template: PageTemplate, chunk_hashes: Sequence[bytes], chunk_indices: Sequence[int],
    payload_checksums: Sequence[int], payloads: Sequence[bytes | memoryview] | None = None,
    key: bytes | None = None,
) -> np.ndarray:  # fmt: skip
    """The headers :func:`seal_page` writes for n pages of ``template`` (``(n, hlen)`` uint8),
    their payloads' checksums given; signed under ``key`` (then ``payloads`` are needed). A few
    numpy calls and one xxh3 (and HMAC) per page."""
    n, hlen = len(chunk_hashes), template.hlen
    head = np.tile(_expected_header(template), (n, 1))
    if n:
        head[:, _HASH] = np.frombuffer(b"".join(chunk_hashes), dtype=np.uint8).reshape(n, -1)
        head[:, _INDEX] = np.asarray(chunk_indices, dtype="<u4").view(np.uint8).reshape(n, 4)
        sums = np.asarray([c & ((1 << 64) - 1) for c in payload_checksums], dtype="<u8")
        head[:, _PAYLOAD_SUM] = sums.view(np.uint8).reshape(n, 8)
    if key:
        assert payloads is not None
        for row, payload in zip(head, payloads, strict=True):
            row[_MAC] = np.frombuffer(_mac(key, row.tobytes(), memoryview(payload)), dtype=np.uint8)
    checks = np.fromiter((xxhash.xxh3_64_intdigest(row) for row in head), dtype="<u8", count=n)
    out = np.empty((n, hlen), dtype=np.uint8)
    out[:, : hlen - _CHECKSUM.size] = head
    out[:, hlen - _CHECKSUM.size :] = checks.view(np.uint8).reshape(n, 8)
    return out


def check_headers(
    headers: np.ndarray, template: PageTemplate, chunk_hashes: Sequence[bytes], chunk_indices: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """:func:`check_header` of many pages at once: ``headers`` is ``(n, template.hlen)`` uint8,
    the first bytes of n pages of ``template`` whose lengths the caller checked. Returns, per
    page, whether it passes (bool) and the payload checksum it states (uint64). A few numpy
    calls and one xxh3 per header; call :func:`check_header` on a failed page for its error."""
    n, hlen = len(chunk_hashes), template.hlen
    if headers.shape != (n, hlen) or headers.dtype != np.uint8:
        raise ValueError(f"check_headers: expected ({n}, {hlen}) uint8 headers, got {headers.shape}")
    head = headers[:, : hlen - _CHECKSUM.size]
    same = head == _expected_header(template)
    same[:, _PAYLOAD_SUM] = True
    same[:, _MAC] = True
    same[:, _HASH] = head[:, _HASH] == np.frombuffer(b"".join(chunk_hashes), dtype=np.uint8).reshape(n, -1)
    index = np.asarray(chunk_indices, dtype="<u4").view(np.uint8).reshape(n, 4)
    same[:, _INDEX] = head[:, _INDEX] == index
    ok = same.all(axis=1)
    stored = np.ascontiguousarray(headers[:, hlen - _CHECKSUM.size :]).view("<u8")[:, 0]
    sums = np.fromiter((xxhash.xxh3_64_intdigest(row) for row in np.ascontiguousarray(head)),
                       dtype=np.uint64, count=n)  # fmt: skip
    ok &= sums == stored
    payload_sums = np.ascontiguousarray(head[:, _PAYLOAD_SUM]).view("<u8")[:, 0]
    return ok, payload_sums


_IDENTITY = ("fingerprint", "chunk_hash", "group_index", "kind", "chunk_index", "num_tokens", "shard",
             "shards", "layer_start", "layer_end", "layers")  # fmt: skip


def _check_mac(view: memoryview, hlen: int, payload: memoryview, key: bytes) -> None:
    mac = bytes(view[_MAC_OFFSET:_FIXED.size])
    if mac == _NO_MAC:
        raise PageFormatError("page is not signed, and this cache requires signed pages")
    unsigned = bytearray(view[: hlen - _CHECKSUM.size])
    unsigned[_MAC_OFFSET:_FIXED.size] = _NO_MAC
    if not hmac.compare_digest(mac, _mac(key, unsigned, payload)):
        raise PageFormatError("page signature does not verify under this cache's key")


def _check_expected(got: PageHeader, want: PageHeader) -> None:
    for name in _IDENTITY:
        if getattr(got, name) != getattr(want, name):
            raise PageFormatError(f"page {name} is {getattr(got, name)!r}, expected {getattr(want, name)!r}")
    shapes = [(t.shape, t.dtype) for t in got.tensors]
    if shapes != [(t.shape, t.dtype) for t in want.tensors]:
        raise PageFormatError("page tensor shapes/dtypes differ from the model's")
