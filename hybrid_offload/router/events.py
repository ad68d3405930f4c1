"""Decode one KV events payload of vLLM's ZMQ publisher without vLLM.

The payload (the last frame of ``(topic, seq, payload)``) is msgspec's msgpack of vLLM 0.32's
``KVEventBatch`` (``vllm/distributed/kv_events.py``): an ARRAY ``[ts, [event, ...], dp_rank]``
(``array_like``; the rank may be absent or nil), each event a MAP tagged ``"type"``
(``BlockStored`` | ``BlockRemoved`` | ``AllBlocksCleared``) with the struct's fields, those at
their default left out (``omit_defaults``: ``group_idx``, ``kv_cache_spec_kind``, ``locality``,
... appear only when set; ``parent_block_hash``, ``lora_id``, ``medium``, ``lora_name`` have no
default and always appear, nil or not). Hashes are ints (64-bit) or bytes.

Events of other types are skipped (a newer engine may send more); unknown fields are ignored.
A payload that is no such batch, or a known event with fields of the wrong type, raises
:class:`MalformedBatchError` (the subscriber counts and skips it), also one nested too deep to
decode (``RecursionError``: a 2 KB payload of nested arrays).

**Bounded decoding** (a payload may come from anyone who can reach the router, issue 45 N6).
Nothing is decoded without a type: the batch and each known event decode straight into typed
structs (msgspec checks an array's length from its header, before building it), unknown fields
and events are skipped without building them, ``token_ids`` stay msgpack until read
(:class:`TokenIds`: the router reads only a few) and ``extra_keys`` are only checked for a
non-nil entry. Refused as malformed: a payload over :data:`MAX_PAYLOAD_BYTES`, more than
:data:`MAX_EVENTS` events, more than :data:`MAX_HASHES` hashes in one event or
:data:`MAX_BATCH_HASHES` in the batch, a negative hash or one of over 64 bytes, a name
(``medium``, kind, locality, ownership) over :data:`MAX_NAME` characters. So decoding one
payload holds at most about 16 times its size (a list of small hash ints: a Python int and a
pointer each; vLLM's batches 1 to 4 times), where untyped decoding held up to 76 times (nested
empty arrays); tests/unit/test_router_bounds.py measures it. Each limit is above what a
legitimate batch that fits in :data:`MAX_PAYLOAD_BYTES` holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, overload

import msgspec

Hash = int | bytes

#: the largest payload decoded (the subscriber's sockets refuse larger messages too)
MAX_PAYLOAD_BYTES = 64 << 20
#: events in one batch (a legitimate event takes 60 bytes or more)
MAX_EVENTS = 1 << 20
#: hashes in one event (a request of 16M tokens in blocks of 16) and in one batch
MAX_HASHES = 1 << 20
MAX_BATCH_HASHES = 1 << 23
#: characters of a medium, kind, locality or ownership (a LoRA name: 4 times more)
MAX_NAME = 256

_NIL = 0xC0


class MalformedBatchError(ValueError):
    """A payload that is not a KV event batch (or exceeds a decoding limit)."""


def _array_length(raw: bytes | memoryview, what: str) -> tuple[int, int]:
    """``(length, header bytes)`` of the msgpack array ``raw``; raises MalformedBatchError."""
    first = raw[0] if len(raw) else -1
    if 0x90 <= first <= 0x9F:
        return first & 0x0F, 1
    if first == 0xDC and len(raw) >= 3:
        return int.from_bytes(raw[1:3], "big"), 3
    if first == 0xDD and len(raw) >= 5:
        return int.from_bytes(raw[1:5], "big"), 5
    raise MalformedBatchError(f"{what} is not an array")


class TokenIds(Sequence[int]):
    """A ``BlockStored``'s token ids, kept as the payload's msgpack until first read (then
    decoded once; a wrong element raises :class:`MalformedBatchError` there). Compares equal
    to any sequence of the same ints."""

    __slots__ = ("_len", "_raw", "_values")

    def __init__(self, raw: msgspec.Raw) -> None:
        view = memoryview(raw)
        self._raw = raw
        self._len = 0 if not len(view) else _array_length(view, "token_ids")[0]
        self._values: tuple[int, ...] | None = None if self._len else ()

    def _all(self) -> tuple[int, ...]:
        if self._values is None:
            try:
                self._values = msgspec.msgpack.decode(self._raw, type=tuple[int, ...])
            except (msgspec.DecodeError, RecursionError) as exc:
                raise MalformedBatchError(f"token_ids: {type(exc).__name__}: {exc}") from None
        return self._values

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...
    def __getitem__(self, i: int | slice) -> int | tuple[int, ...]:
        return self._all()[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds | tuple | list):
            return len(other) == self._len and self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return f"TokenIds({self._len} tokens)"


@dataclass(frozen=True, slots=True)
class Stored:
    """A medium gained blocks. ``hashes[i]`` names the prefix ending at the end of the block
    ``i`` (blocks of ``block_size`` tokens, ``parent`` the hash before the first; a mamba-kind
    hash names the state at that position). ``medium`` None: vLLM's GPU cache; ``kind``:
    ``full_attention`` | ``sliding_window`` (``sliding_window`` tokens) | ``mamba`` | None;
    ``has_extra_keys``: hashed with LoRA / multimodal / salt keys (no plain prompt matches)."""

    hashes: tuple[Hash, ...]
    parent: Hash | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None
    group_idx: int | None
    kind: str | None
    sliding_window: int | None
    locality: str | None
    ownership: str | None
    has_extra_keys: bool = False


@dataclass(frozen=True, slots=True)
class Removed:
    """A medium lost the blocks ``hashes`` (of ``group_idx``; None: of every group)."""

    hashes: tuple[Hash, ...]
    medium: str | None
    group_idx: int | None
    locality: str | None
    ownership: str | None


@dataclass(frozen=True, slots=True)
class Cleared:
    """The engine emptied its GPU prefix cache (``reset_prefix_cache``)."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None


# ---- wire mirrors of vLLM's structs (every field optional but the hashes) --------------------
_WireHash = Annotated[int, msgspec.Meta(ge=0)] | Annotated[bytes, msgspec.Meta(max_length=64)]
_Hashes = Annotated[tuple[_WireHash, ...], msgspec.Meta(max_length=MAX_HASHES)]
_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
_NO_RAW = msgspec.Raw()


class _Tag(msgspec.Struct):
    type: str


class _Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: _Hashes
    parent_block_hash: _WireHash | None = None
    token_ids: msgspec.Raw = _NO_RAW
    block_size: int = 0
    lora_id: int | None = None
    medium: _Name | None = None
    lora_name: Annotated[str, msgspec.Meta(max_length=4 * MAX_NAME)] | None = None
    extra_keys: msgspec.Raw = _NO_RAW
    group_idx: int | None = None
    kv_cache_spec_kind: _Name | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: _Name | None = None
    ownership: _Name | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: _Hashes
    medium: _Name | None = None
    group_idx: int | None = None
    locality: _Name | None = None
    ownership: _Name | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float
    events: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_EVENTS)]
    dp_rank: int | None = None


_KNOWN = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
_TAG = msgspec.msgpack.Decoder(_Tag)
_WIRE = msgspec.msgpack.Decoder(_Stored | _Removed | _Cleared)
_BATCH = msgspec.msgpack.Decoder(_Batch)
_CLEARED = Cleared()


def _keyed(extra_keys: msgspec.Raw) -> bool:
    """Whether ``extra_keys`` (nil, or vLLM's list of one entry per block, None for a block
    hashed without extra keys) holds a non-nil entry; read without decoding the entries."""
    view = memoryview(extra_keys)
    if not len(view) or view[0] == _NIL:
        return False
    n, header = _array_length(view, "extra_keys")
    # n nils take n bytes; any other entry of one byte (an int, "", [], {}) counts as a key
    return len(view) - header != n or view[header:] != bytes([_NIL]) * n


def _event(raw: msgspec.Raw) -> Event | None:
    try:
        tag = _TAG.decode(raw).type
        if tag not in _KNOWN:
            return None
        wire = _WIRE.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
        raise MalformedBatchError(f"an event: {type(exc).__name__}: {exc}") from None
    if isinstance(wire, _Stored):
        keyed = wire.lora_id or wire.lora_name or _keyed(wire.extra_keys)
        return Stored(
            hashes=wire.block_hashes,
            parent=wire.parent_block_hash,
            token_ids=TokenIds(wire.token_ids),
            block_size=wire.block_size,
            medium=wire.medium,
            group_idx=wire.group_idx,
            kind=wire.kv_cache_spec_kind,
            sliding_window=wire.kv_cache_spec_sliding_window,
            locality=wire.locality,
            ownership=wire.ownership,
            has_extra_keys=bool(keyed),
        )
    if isinstance(wire, _Removed):
        return Removed(wire.block_hashes, wire.medium, wire.group_idx, wire.locality, wire.ownership)
    return _CLEARED


def decode_batch(payload: bytes) -> Batch:
    """One payload's batch; raises :class:`MalformedBatchError` (limits: module docstring)."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise MalformedBatchError(f"a payload of {len(payload)} bytes (at most {MAX_PAYLOAD_BYTES})")
    try:
        batch = _BATCH.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise MalformedBatchError(f"not a [ts, events, dp_rank] batch: {type(exc).__name__}: {exc}") from None
    events: list[Event] = []
    hashes = 0
    for raw in batch.events:
        event = _event(raw)
        if event is None:
            continue
        if not isinstance(event, Cleared):
            hashes += len(event.hashes)
            if hashes > MAX_BATCH_HASHES:
                raise MalformedBatchError(f"more than {MAX_BATCH_HASHES} hashes in one batch")
        events.append(event)
    return Batch(batch.ts, tuple(events), batch.dp_rank)
