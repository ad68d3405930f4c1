"""Images (and other multimodal items) in page keys.

vLLM fills an image's placeholder run with the same token ids for every image of one size, so
tokens alone would give one image another's KV. Chunk ``c`` of a request is keyed, besides its
tokens, by every item whose placeholder run overlaps the chunk: ``[modality, identity, offset of
the run from the chunk's start, run length]`` (vLLM's block hash carries ``("mm", identifier,
offset - block start)`` per block the same way); the chain carries it into every later chunk,
whose KV and state depend on the image too.

An item's identity, as ``multimodal_keys`` says:

* ``content`` (default): :func:`~hybrid_offload.engine.multimodal.item_digest` of the
  processed item the scheduler holds, what the model reads. A request with an item whose
  tensors the scheduler does not hold (``mm_processor_cache_type: shm``) skips the cache.
* ``identifier``: vLLM's ``identifier`` as it is, no hashing in the scheduler: for deployments
  whose clients are trusted, since a client may name its image with another image's id (a
  ``uuid``) and so store KV that others load. Refused where vLLM's identifiers are per-process
  counters (:func:`~hybrid_offload.engine.multimodal.identifiers_name_content`).
* ``off``: requests with multimodal items skip the cache.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from hybrid_offload.connector.scheduler.scope import ScopeError
from hybrid_offload.engine.multimodal import item_digest

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: first byte of a chunk's extras (a later encoding takes another)
_TAG = b"\x01"


def chunk_extras(request: Request, chunk_tokens: int, mode: str = "content") -> dict[int, bytes]:
    """Per chunk index, the bytes that key the request's multimodal items overlapping that chunk
    (see the module docstring); empty without items. Raises :class:`ScopeError` where the request
    cannot use the cache (``mode`` ``off``, an item that cannot be named)."""
    features = getattr(request, "mm_features", None) or ()
    if not features:
        return {}
    if mode == "off":
        raise ScopeError("requests with multimodal inputs skip the cache (multimodal_keys: off)")
    per_chunk: dict[int, list[list[Any]]] = defaultdict(list)
    for n, feature in enumerate(features):
        identity = _identity(feature, mode, n)
        position = getattr(feature, "mm_position", None)
        try:
            start, length = int(position.offset), int(position.length)  # type: ignore[union-attr]
        except (AttributeError, TypeError, ValueError):
            raise ScopeError(f"multimodal item {n} has no placeholder position") from None
        if length <= 0:
            continue
        modality = str(getattr(feature, "modality", ""))
        for c in range(start // chunk_tokens, (start + length - 1) // chunk_tokens + 1):
            per_chunk[c].append([modality, identity, start - c * chunk_tokens, length])
    return {
        c: _TAG + json.dumps(items, separators=(",", ":"), ensure_ascii=True).encode()
        for c, items in per_chunk.items()
    }


def _identity(feature: Any, mode: str, n: int) -> str:
    if mode == "identifier":
        identifier = getattr(feature, "identifier", None)
        if not isinstance(identifier, str) or not identifier:
            raise ScopeError(f"multimodal item {n} has no identifier")
        return "id:" + identifier
    digest = item_digest(getattr(feature, "data", None))
    if digest is None:
        raise ScopeError(
            f"the scheduler holds no data for multimodal item {n} ({getattr(feature, 'modality', '?')}) "
            "to key it by (mm_processor_cache_type shm passes addresses; multimodal_keys: identifier "
            "trusts vLLM's identifiers instead)"
        )
    return "content:" + digest
