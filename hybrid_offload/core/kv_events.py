"""What our KV events say, independent of vLLM: the contract a router reads (docs/operations.md,
"KV events").

The connector publishes through vLLM's own KV events channel one ``BlockStored`` per page set a
tier gained and one ``BlockRemoved`` per page set it saw a tier lose, in vLLM's block hashes:

* vLLM hashes a request every ``hash_block_size`` tokens, chained, and names a block spanning
  several of those by the last (as it names its own larger blocks). Positions between two of its
  hashes have no name, so we publish blocks of ``S = lcm(chunk_tokens, hash_block_size)`` tokens
  (:meth:`KVEventsSpec.block_tokens`): a block ending at token ``p`` (a multiple of ``S``) carries
  the request's vLLM hash at ``p``, the hash at ``p - S`` as parent, its ``S`` tokens and
  ``block_size = S``.
* Attention groups (``full_attention``, ``sliding_window``): the tier holds the KV of every token
  of the block (every page set of the chunks in it). State groups (``mamba``): the tier holds
  the recurrent state after exactly ``p`` tokens (a checkpoint at ``p``), nothing about earlier
  positions; a state at a chunk boundary that is no multiple of ``S`` is not published (a router
  could not name it), so a router may see up to ``S - chunk_tokens`` tokens less than an engine
  restores.
* ``medium`` is the tier's name; ``locality`` is :data:`LOCAL` for a tier only this engine reads
  (the cpu pool), :data:`REMOTE` for one other engines may read too (a router pools those);
  ``ownership`` is :data:`OWNERSHIP`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: ``ownership`` of every event we publish
OWNERSHIP = "hybrid-offload"
#: ``locality`` of a tier only the publishing engine reads
LOCAL = "LOCAL"
#: ``locality`` of a tier other engines may read too (disk, Redis, a cache peer, LMCache)
REMOTE = "REMOTE"

def external_hash(digest: bytes, as_int: bool = True) -> int | bytes:
    """A block hash as events carry it (vLLM's ``maybe_convert_block_hash``): the low 64 bits of
    the big-endian digest when ``as_int`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, vLLM's
    default), else the digest itself."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1) if as_int else digest


#: page sets (and as many blocks) remembered between their store and their removal (LRU)
MAX_PUBLISHED_SETS = 1 << 18


@dataclass(frozen=True)
class KVEventsSpec:
    """vLLM's KV events as the engine runs them: its requests' block hashes cover
    ``hash_block_size`` tokens each; ``int_hashes``: events carry them as 64-bit ints
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, vLLM's default) instead of bytes."""

    hash_block_size: int
    int_hashes: bool = True
    #: ``BlockStored`` carries the block's token ids (False: an empty list; hashes only)
    token_ids: bool = True

    def block_tokens(self, chunk_tokens: int) -> int:
        """Tokens of one published block: the shortest span both our chunks and vLLM's hashes
        end on."""
        return math.lcm(chunk_tokens, self.hash_block_size)

    def hash_index(self, end_token: int) -> int | None:
        """Index in a request's ``block_hashes`` of the hash at token ``end_token``; None when
        ``end_token`` is not on a hash boundary."""
        if end_token <= 0 or end_token % self.hash_block_size:
            return None
        return end_token // self.hash_block_size - 1

    def external(self, digest: bytes) -> int | bytes:
        """A block hash as this engine's events carry it (:func:`external_hash`)."""
        return external_hash(digest, self.int_hashes)
