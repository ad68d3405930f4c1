"""Model cards: a small, self-describing record of which model a key namespace belongs to.

A page key is ``<fingerprint>-<digest>``, and the fingerprint is a hash: it says nothing a
person can read. So each engine (TP rank 0) writes one *model card* per writable, shared
backend at start-up, under :func:`card_key` ``(fingerprint)`` = ``<fingerprint>-000...0`` (32
zeros). That is a valid page key (:data:`~hybrid_offload.backends.base.KEY_PATTERN`), so every
backend stores, evicts, lists and deletes it like a page, but no page can collide with it in
practice: page digests are xxh3-128 hashes, and one being all zeros has probability 2^-128.
``hybrid-offload cache`` reads the cards to name the model of each fingerprint.

Layout (little-endian)::

    magic      4 bytes  b"HOMC"
    version    u16      CARD_VERSION
    json_len   u32      length of the JSON that follows
    json       canonical JSON of the card (sorted keys, no spaces, UTF-8)
    checksum   u64      xxh3-64 of everything above
    signature  32 bytes HMAC-SHA256 of everything above under the cache secret's page subkey
                        (only where the engine has a cache secret)

Cards are written by every engine of a tier, so without a signature a card says what its
writer chose: a reader with the secret (``cache --secret-file``) trusts only signed cards; a
reader without it shows what cards say escaped.

A card is at most :data:`MAX_CARD_BYTES`; decoding checks every size and field before using it
and raises :class:`ModelCardError` naming what is wrong. No pickle, no eval. JSON keys a reader
does not know are ignored (a later writer may add fields without a new card version).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import math
import re
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from hybrid_offload import FORMAT_VERSION

if TYPE_CHECKING:
    from hybrid_offload.core.spec import ModelSpec

__all__ = [
    "CARD_DIGEST",
    "CARD_MAGIC",
    "CARD_VERSION",
    "MAX_CARD_BYTES",
    "CardGroup",
    "ModelCard",
    "ModelCardError",
    "card_from_spec",
    "card_key",
    "card_problem",
    "decode_card",
    "describe_card",
    "encode_card",
    "is_card_key",
]

CARD_MAGIC = b"HOMC"
CARD_VERSION = 1
MAX_CARD_BYTES = 64 << 10
_SIGNATURE_BYTES = 32
#: the digest half of every card key
CARD_DIGEST = "0" * 32

_HEAD = struct.Struct("<4sHI")
_CHECKSUM = struct.Struct("<Q")
_FINGERPRINT = re.compile(r"\A[0-9a-f]{8,64}\Z")


class ModelCardError(ValueError):
    """The bytes are not a valid model card (the message says why)."""


@dataclass(frozen=True)
class CardGroup:
    """One KV cache group: its index, kind (``GroupKind`` value), layer count and shards per
    (chunk, group) page set."""

    index: int
    kind: str
    layers: int
    shards: int


@dataclass(frozen=True)
class ModelCard:
    """What an operator needs to tell a fingerprint's model: the fields of
    ``ModelSpec.fingerprint_fields`` that a person reads, plus the chunk size.

    ``format_version`` is the page format version (``hybrid_offload.FORMAT_VERSION``);
    ``written_at`` the writer's wall clock (seconds since the epoch).
    """

    fingerprint: str
    name: str
    revision: str | None
    architectures: tuple[str, ...]
    dtype: str
    kv_cache_dtype: str
    chunk_tokens: int
    groups: tuple[CardGroup, ...]
    format_version: int
    written_at: float

    def to_json(self) -> dict[str, Any]:
        """The card as plain JSON data (what :func:`encode_card` stores)."""
        return {
            "fingerprint": self.fingerprint,
            "name": self.name,
            "revision": self.revision,
            "architectures": list(self.architectures),
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "chunk_tokens": self.chunk_tokens,
            "groups": [dataclasses.asdict(g) for g in self.groups],
            "format_version": self.format_version,
            "written_at": self.written_at,
        }


def card_key(fingerprint: str) -> str:
    """The backend key of ``fingerprint``'s card: ``<fingerprint>-`` and 32 zeros."""
    if not isinstance(fingerprint, str) or _FINGERPRINT.match(fingerprint) is None:
        raise ModelCardError(f"fingerprint {fingerprint!r} is not 8-64 lowercase hex digits")
    return f"{fingerprint}-{CARD_DIGEST}"


def is_card_key(key: str) -> bool:
    """Whether ``key`` is a model card's key (not a page's)."""
    fingerprint, sep, digest = key.partition("-")
    return sep == "-" and digest == CARD_DIGEST and _FINGERPRINT.match(fingerprint) is not None


def card_from_spec(spec: ModelSpec, chunk_tokens: int, written_at: float | None = None) -> ModelCard:
    """The card of an engine's model: from ``spec.fingerprint_fields`` (as
    ``core.spec.make_model_spec`` builds them; fields it lacks are empty) and its groups."""
    model = spec.fingerprint_fields.get("model") or {}
    revision = model.get("revision")
    return ModelCard(
        fingerprint=spec.fingerprint,
        name=str(model.get("name", "")),
        revision=None if revision is None else str(revision),
        architectures=tuple(str(a) for a in model.get("architectures") or ()),
        dtype=str(model.get("dtype", "")),
        kv_cache_dtype=str(model.get("kv_cache_dtype", "")),
        chunk_tokens=chunk_tokens,
        groups=tuple(CardGroup(g.index, g.kind.value, len(g.layer_names), g.shards) for g in spec.groups),
        format_version=int(spec.fingerprint_fields.get("format_version", FORMAT_VERSION)),
        written_at=time.time() if written_at is None else written_at,
    )


def encode_card(card: ModelCard, key: bytes | None = None) -> bytes:
    """The card's bytes (module docstring), signed under ``key`` (the page subkey) if given;
    ModelCardError if a field is invalid or the card would exceed :data:`MAX_CARD_BYTES`."""
    data = card.to_json()
    _card_from_json(data)  # what decode_card would refuse is never written
    try:
        blob = json.dumps(
            data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ModelCardError(f"model card is not JSON-serializable: {exc}") from exc
    size = _HEAD.size + len(blob) + _CHECKSUM.size + (0 if key is None else _SIGNATURE_BYTES)
    if size > MAX_CARD_BYTES:
        raise ModelCardError(f"model card would be {size} bytes, more than {MAX_CARD_BYTES}")
    body = _HEAD.pack(CARD_MAGIC, CARD_VERSION, len(blob)) + blob
    body += _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))
    return body if key is None else body + hmac.digest(key, body, "sha256")


def decode_card(data: bytes | bytearray | memoryview, key: bytes | None = None) -> ModelCard:
    """Verify and parse a card; ModelCardError says what is wrong with it. With ``key`` (the
    page subkey) a card must be signed under it; without, a signature is not checked."""
    view = memoryview(data).cast("B")
    if len(view) > MAX_CARD_BYTES:
        raise ModelCardError(f"model card is {len(view)} bytes, more than {MAX_CARD_BYTES}")
    if len(view) < _HEAD.size + _CHECKSUM.size:
        raise ModelCardError(f"model card too short ({len(view)} bytes)")
    magic, version, json_len = _HEAD.unpack_from(view, 0)
    if magic != CARD_MAGIC:
        raise ModelCardError("bad magic: not a hybrid-offload model card")
    if version != CARD_VERSION:
        raise ModelCardError(f"model card format version {version}, expected {CARD_VERSION}")
    unsigned = _HEAD.size + json_len + _CHECKSUM.size
    if len(view) not in (unsigned, unsigned + _SIGNATURE_BYTES):
        raise ModelCardError(
            f"model card length mismatch: header says {json_len} JSON bytes, "
            f"the card holds {len(view) - _HEAD.size - _CHECKSUM.size}"
        )
    if key is not None:
        if len(view) == unsigned:
            raise ModelCardError("model card is not signed (the cache secret requires it)")
        if not hmac.compare_digest(hmac.digest(key, view[:unsigned], "sha256"), view[unsigned:]):
            raise ModelCardError("model card signature does not match the cache secret")
    view = view[:unsigned]
    end = len(view) - _CHECKSUM.size
    (stored,) = _CHECKSUM.unpack_from(view, end)
    if xxhash.xxh3_64_intdigest(view[:end]) != stored:
        raise ModelCardError("model card checksum mismatch")
    try:
        parsed = json.loads(str(view[_HEAD.size : end], "utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ModelCardError(f"model card JSON is invalid: {exc}") from None
    return _card_from_json(parsed)


def card_problem(key: str, data: bytes, secret_key: bytes | None = None) -> str | None:
    """Why the card stored under ``key`` is not valid (with ``secret_key``: not signed under
    it), or None if it is (for ``verify``)."""
    try:
        card = decode_card(data, secret_key)
    except ModelCardError as exc:
        return str(exc)
    namespace = key.partition("-")[0]
    if card.fingerprint != namespace:
        return f"model card fingerprint {card.fingerprint} is not the key's namespace {namespace}"
    return None


# -- field checks -------------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(data: dict[str, Any], name: str, ok: Any, want: str, where: str = "") -> Any:
    if name not in data:
        raise ModelCardError(f"model card field {where + name!r} is missing")
    value = data[name]
    if not ok(value):
        raise ModelCardError(f"model card field {where + name!r} must be {want}, got {value!r:.80}")
    return value


def _group(i: int, value: Any) -> CardGroup:
    if not isinstance(value, dict):
        raise ModelCardError(f"model card field 'groups[{i}]' must be an object, got {value!r:.80}")
    where = f"groups[{i}]."
    return CardGroup(
        index=_field(value, "index", lambda v: _is_int(v) and v >= 0, "an integer >= 0", where),
        kind=_field(value, "kind", lambda v: isinstance(v, str) and v, "a non-empty string", where),
        layers=_field(value, "layers", lambda v: _is_int(v) and v >= 0, "an integer >= 0", where),
        shards=_field(value, "shards", lambda v: _is_int(v) and v >= 1, "an integer >= 1", where),
    )


def _text(v: Any) -> bool:
    return isinstance(v, str)


def _texts(v: Any) -> bool:
    return isinstance(v, list) and all(map(_text, v))


#: 9999-12-31T23:59:59Z: a later ``written_at`` is not a time (``time.gmtime`` cannot show it)
MAX_TIMESTAMP = 253402300799.0


def _timestamp(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and 0 <= v <= MAX_TIMESTAMP


def _card_from_json(data: Any) -> ModelCard:
    if not isinstance(data, dict):
        raise ModelCardError(f"model card JSON must be an object, got {type(data).__name__}")
    hex_id = "8-64 lowercase hex digits"
    groups = _field(data, "groups", lambda v: isinstance(v, list), "a list")
    return ModelCard(
        fingerprint=_field(data, "fingerprint", lambda v: _text(v) and _FINGERPRINT.match(v), hex_id),
        name=_field(data, "name", _text, "a string"),
        revision=_field(data, "revision", lambda v: v is None or _text(v), "a string or null"),
        architectures=tuple(_field(data, "architectures", _texts, "a list of strings")),
        dtype=_field(data, "dtype", _text, "a string"),
        kv_cache_dtype=_field(data, "kv_cache_dtype", _text, "a string"),
        chunk_tokens=_field(data, "chunk_tokens", lambda v: _is_int(v) and v > 0, "an integer > 0"),
        groups=tuple(_group(i, g) for i, g in enumerate(groups)),
        format_version=_field(data, "format_version", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
        written_at=float(_field(data, "written_at", _timestamp, "seconds since 1970, before the year 10000")),
    )


def describe_card(key: str, data: bytes, secret_key: bytes | None = None) -> dict[str, Any]:
    """Every field of the card stored under ``key`` and its verdict (``cache inspect``; with
    ``secret_key``, only a card signed under it is valid)."""
    info: dict[str, Any] = {"key": key, "size": len(data), "type": "model card"}
    try:
        card = decode_card(data)
    except ModelCardError as exc:
        return {**info, "valid": False, "error": str(exc)}
    info.update(card.to_json())
    info["written_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(card.written_at))
    info["fingerprint_matches_key"] = card.fingerprint == key.partition("-")[0]
    unsigned = _HEAD.size + _HEAD.unpack_from(data, 0)[2] + _CHECKSUM.size
    info["signed"] = len(data) == unsigned + _SIGNATURE_BYTES
    problem = card_problem(key, data, secret_key)
    info["valid"] = problem is None
    if problem is not None:
        info["error"] = problem
    return info
