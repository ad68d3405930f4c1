"""Router side of KV events: which engine can restore how much of a prompt, from the engines'
KV event streams (pure Python: no vLLM, no torch). See docs/operations.md, "KV events"."""

from hybrid_offload.router.events import Cleared, Removed, Stored, decode_batch
from hybrid_offload.router.hashing import block_hashes
from hybrid_offload.router.index import CacheIndex
from hybrid_offload.router.subscriber import EventSubscriber, SubscriberStats

__all__ = [
    "CacheIndex",
    "Cleared",
    "EventSubscriber",
    "Removed",
    "Stored",
    "SubscriberStats",
    "block_hashes",
    "decode_batch",
]
