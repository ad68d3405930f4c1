"""Decode vLLM's KV event batches without vLLM.

A ZMQ message's payload is msgpack of ``KVEventBatch``: ``[ts, [event, ...], dp_rank]`` (the
rank may be absent); each event a map tagged ``"type"`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) with the struct's non-default fields. Other event types are skipped (a
newer engine may send more); a payload that is not such a batch raises :class:`MalformedBatchError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

Hash = int | bytes


class MalformedBatchError(ValueError):
    """A payload that is not a KV event batch."""


@dataclass(frozen=True)
class Stored:
    """Blocks a medium gained (``hashes[-1]`` names the prefix ending at the last token)."""

    hashes: tuple[Hash, ...]
    parent: Hash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None
    group: int | None
    kind: str | None
    sliding_window: int | None
    locality: str | None
    ownership: str | None


@dataclass(frozen=True)
class Removed:
    hashes: tuple[Hash, ...]
    medium: str | None
    group: int | None
    locality: str | None
    ownership: str | None


@dataclass(frozen=True)
class Cleared:
    """The engine emptied its GPU prefix cache."""


Event = Stored | Removed | Cleared


def _hashes(raw: Any) -> tuple[Hash, ...]:
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise MalformedBatchError(f"block_hashes is not a list: {raw!r:.80}")
    return tuple(raw)


def _event(raw: Any) -> Event | None:
    if not isinstance(raw, dict):
        raise MalformedBatchError(f"an event is not a map: {raw!r:.80}")
    kind = raw.get("type")
    if kind == "BlockStored":
        return Stored(
            hashes=_hashes(raw.get("block_hashes")),
            parent=raw.get("parent_block_hash"),
            token_ids=tuple(raw.get("token_ids") or ()),
            block_size=int(raw.get("block_size") or 0),
            medium=raw.get("medium"),
            group=raw.get("group_idx"),
            kind=raw.get("kv_cache_spec_kind"),
            sliding_window=raw.get("kv_cache_spec_sliding_window"),
            locality=raw.get("locality"),
            ownership=raw.get("ownership"),
        )
    if kind == "BlockRemoved":
        return Removed(
            hashes=_hashes(raw.get("block_hashes")),
            medium=raw.get("medium"),
            group=raw.get("group_idx"),
            locality=raw.get("locality"),
            ownership=raw.get("ownership"),
        )
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(payload: bytes) -> tuple[float, list[Event]]:
    """``(ts, events)`` of one payload; raises :class:`MalformedBatchError`."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedBatchError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise MalformedBatchError(f"not a [ts, events, ...] batch: {raw!r:.80}")
    try:
        events = [e for e in (_event(r) for r in raw[1]) if e is not None]
        return float(raw[0]), events
    except (TypeError, ValueError) as exc:
        if isinstance(exc, MalformedBatchError):
            raise
        raise MalformedBatchError(str(exc)) from None
