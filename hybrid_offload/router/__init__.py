"""The router side of KV events (pure Python: no vLLM, no torch): which engine can restore how
much of a prompt, from its GPU prefix cache and from each tier, learned from the engines' event
streams. docs/operations.md, "KV events"; the contract: ``hybrid_offload/core/kv_events.py``.

* :mod:`.hashing`: vLLM's prompt block hashes, recomputed;
* :mod:`.events`: one ZMQ payload (msgpack ``KVEventBatch``) decoded;
* :mod:`.index`: :class:`CacheIndex`, restorable prefixes per engine and medium, routing;
* :mod:`.subscriber`: :class:`EventSubscriber`, one engine's stream (sequence, replay) into an index.
"""

from hybrid_offload.router.events import (
    Batch,
    Cleared,
    MalformedBatchError,
    Removed,
    Stored,
    TokenIds,
    decode_batch,
)
from hybrid_offload.router.hashing import HashAlgoError, block_hashes, external
from hybrid_offload.router.index import CacheIndex, IndexStats
from hybrid_offload.router.subscriber import EventSubscriber, SubscriberStats

__all__ = [
    "Batch",
    "CacheIndex",
    "Cleared",
    "EventSubscriber",
    "HashAlgoError",
    "IndexStats",
    "MalformedBatchError",
    "Removed",
    "Stored",
    "SubscriberStats",
    "TokenIds",
    "block_hashes",
    "decode_batch",
    "external",
]
