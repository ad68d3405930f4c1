"""What keys a chunk besides its token ids: images (and other multimodal items) and prompt
embeddings.

Token ids alone would give one input another's KV: vLLM fills an image's placeholder run with
the same ids for every image of one size, and a prompt given as embeddings has no ids (vLLM
holds 0 at each of its positions). So chunk ``c`` of a request is keyed, besides its tokens, by
:func:`chunk_extras`, as vLLM's block hash carries extra keys per block; the chain carries them
into every later chunk, whose KV and state depend on those inputs too:

* every multimodal item whose placeholder run overlaps the chunk: ``[modality, identity, offset
  of the run from the chunk's start, run length]`` (vLLM: ``("mm", identifier, offset - block
  start)``);
* a prompt given as embeddings: ``["prompt_embeds", digest of the chunk's rows]``, with the
  positions that hold token ids instead where a prompt mixes both (vLLM: ``("prompt_embeds",
  sha256 of the block's rows)``).

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
from hybrid_offload.engine.multimodal import item_digest, tensor_digest

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: first byte of a chunk's extras (a later encoding takes another)
_TAG = b"\x01"
#: chunk index -> the items keying it
PerChunk = dict[int, list[list[Any]]]


def chunk_extras(request: Request, chunk_tokens: int, mode: str = "content") -> dict[int, bytes]:
    """Per chunk index, the bytes that key the request's multimodal items and prompt embeddings
    in that chunk (see the module docstring); empty without either. Raises :class:`ScopeError`
    where the request cannot use the cache (multimodal items with ``mode`` ``off``, an item that
    cannot be named)."""
    per_chunk: PerChunk = defaultdict(list)
    _multimodal(request, chunk_tokens, mode, per_chunk)
    _prompt_embeds(request, chunk_tokens, per_chunk)
    return {
        c: _TAG + json.dumps(items, separators=(",", ":"), ensure_ascii=True).encode()
        for c, items in per_chunk.items()
    }


def _multimodal(request: Request, chunk_tokens: int, mode: str, per_chunk: PerChunk) -> None:
    features = getattr(request, "mm_features", None) or ()
    if not features:
        return
    if mode == "off":
        raise ScopeError("requests with multimodal inputs skip the cache (multimodal_keys: off)")
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


def _prompt_embeds(request: Request, chunk_tokens: int, per_chunk: PerChunk) -> None:
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        return
    rows = int(embeds.shape[0])
    is_token = getattr(request, "prompt_is_token_ids", None)  # a prompt mixing ids and embeddings
    for c in range(-(-rows // chunk_tokens)):
        start, end = c * chunk_tokens, min(rows, (c + 1) * chunk_tokens)
        item = ["prompt_embeds", tensor_digest(embeds[start:end])]
        if is_token is not None:
            item.append("".join("t" if t else "e" for t in is_token[start:end]))
        per_chunk[c].append(item)


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
