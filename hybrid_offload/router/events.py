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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

Hash = int | bytes


class MalformedBatchError(ValueError):
    """A payload that is not a KV event batch."""


@dataclass(frozen=True)
class Stored:
    """A medium gained blocks. ``hashes[i]`` names the prefix ending at the end of the block
    ``i`` (blocks of ``block_size`` tokens, ``parent`` the hash before the first; a mamba-kind
    hash names the state at that position). ``medium`` None: vLLM's GPU cache; ``kind``:
    ``full_attention`` | ``sliding_window`` (``sliding_window`` tokens) | ``mamba`` | None;
    ``has_extra_keys``: hashed with LoRA / multimodal / salt keys (no plain prompt matches)."""

    hashes: tuple[Hash, ...]
    parent: Hash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None
    group_idx: int | None
    kind: str | None
    sliding_window: int | None
    locality: str | None
    ownership: str | None
    has_extra_keys: bool = False


@dataclass(frozen=True)
class Removed:
    """A medium lost the blocks ``hashes`` (of ``group_idx``; None: of every group)."""

    hashes: tuple[Hash, ...]
    medium: str | None
    group_idx: int | None
    locality: str | None
    ownership: str | None


@dataclass(frozen=True)
class Cleared:
    """The engine emptied its GPU prefix cache (``reset_prefix_cache``)."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None


# ---- wire mirrors of vLLM's structs (validation only; every field optional but the hashes) ----
class _Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


_KNOWN = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
_Wire = _Stored | _Removed | _Cleared


def _event(raw: Any) -> Event | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise MalformedBatchError(f"an event is not a map tagged 'type': {raw!r:.120}")
    if raw["type"] not in _KNOWN:
        return None
    try:
        wire = msgspec.convert(raw, _Wire, builtin_types=(bytes,))
    except (msgspec.ValidationError, RecursionError) as exc:
        raise MalformedBatchError(f"{raw['type']}: {type(exc).__name__}: {exc}") from None
    if isinstance(wire, _Stored):
        # vLLM lists one entry per block, None for a block hashed without extra keys
        keyed = wire.lora_id or wire.lora_name or any(k is not None for k in wire.extra_keys or ())
        return Stored(
            hashes=tuple(wire.block_hashes),
            parent=wire.parent_block_hash,
            token_ids=tuple(wire.token_ids),
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
        return Removed(tuple(wire.block_hashes), wire.medium, wire.group_idx, wire.locality, wire.ownership)
    return Cleared()


def decode_batch(payload: bytes) -> Batch:
    """One payload's batch; raises :class:`MalformedBatchError`."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise MalformedBatchError(f"not msgpack: {type(exc).__name__}: {exc}") from None
    if not (isinstance(raw, list) and 2 <= len(raw) <= 3 and isinstance(raw[1], list)):
        raise MalformedBatchError(f"not a [ts, events, dp_rank] batch: {raw!r:.120}")
    ts, rank = raw[0], raw[2] if len(raw) == 3 else None
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not (rank is None or type(rank) is int):
        raise MalformedBatchError(f"bad ts or dp_rank: {raw[0]!r:.40}, {rank!r:.40}")
    events = tuple(e for e in map(_event, raw[1]) if e is not None)
    return Batch(float(ts), events, rank)
