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
* ``medium`` is the tier's name for a tier only this engine reads (``locality`` :data:`LOCAL`:
  the cpu pool), and ``<name>@<store id>`` for one other engines may read too (:data:`REMOTE`:
  a router pools those by medium): :func:`medium_name`, so that two stores given one name are
  two media and one store seen by several engines (under one name) is one; ``ownership`` is
  :data:`OWNERSHIP`.
* ``extra_keys`` are vLLM's for the block's tokens (``generate_block_hash_extra_keys``,
  published as its own events do): the LoRA name of every block of a LoRA request, the
  ``cache_salt`` of a salted request's first block; None for a block without.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

#: ``ownership`` of every event we publish
OWNERSHIP = "hybrid-offload"
#: ``locality`` of a tier only the publishing engine reads
LOCAL = "LOCAL"
#: ``locality`` of a tier other engines may read too (disk, Redis, a cache peer, LMCache)
REMOTE = "REMOTE"

#: option keys (substrings) never part of a store's identity: credentials and where they are read
_SECRET_KEYS = ("password", "passwd", "pwd", "token", "secret", "credential", "auth")
_LOOPBACK = ("localhost", "::1", "0.0.0.0", "::")


def _local(host: str) -> bool:
    return host.lower().strip("[]") in _LOOPBACK or host.startswith("127.")


def _endpoint(address: str, this_host: str) -> str:
    """``host:port`` (or a URL) as a location: a loopback host names this host's."""
    host = urlsplit(address).hostname if "://" in address else address.rpartition(":")[0] or address
    return f"{address}@{this_host}" if host is not None and _local(host) else address


def _url(url: str, this_host: str, port: int | None = None, path: str = "") -> str:
    """A store URL as a location: scheme, user, host, port (``port`` when it names none), path
    (``path`` when empty) and query, never a password nor a query key that may name one; a
    loopback host names this host."""
    parts = urlsplit(url)
    try:
        where_port: int | str | None = parts.port or port
    except ValueError:  # no number: kept as written
        where_port = parts.netloc.rpartition(":")[2]
    query = sorted((k, v) for k, v in parse_qsl(parts.query) if not any(s in k.lower() for s in _SECRET_KEYS))
    host = (parts.hostname or "").lower()
    where = f"{parts.scheme}://{parts.username or ''}@{host}:{where_port}/{parts.path.strip('/') or path}"
    where += f"?{query}"
    return f"{where}@{this_host}" if _local(host) else where


def store_location(backend_type: str, options: Mapping[str, Any], this_host: str) -> dict[str, Any]:
    """What tells one store of a tier from another (no credentials): a ``disk``'s real path and
    this host; a ``redis`` / ``redis-cluster``'s URL (without password), startup nodes and key
    prefix; a ``nixl_peer``'s sorted peer addresses; any other type's options but those naming
    credentials. A loopback address (and a disk path) is qualified by ``this_host``."""
    if backend_type == "disk":
        return {"type": "disk", "host": this_host, "path": os.path.realpath(str(options.get("path")))}
    if backend_type in ("redis", "redis-cluster"):
        url = options.get("url")
        nodes = sorted(_endpoint(str(n), this_host) for n in options.get("startup_nodes") or ())
        return {
            "type": backend_type,
            "url": None if url is None else _url(str(url), this_host, 6379, "0"),
            "nodes": nodes,
            "prefix": options.get("prefix"),
        }
    if backend_type == "nixl_peer":
        peers = sorted(_endpoint(str(p), this_host) for p in options.get("peers") or ())
        return {"type": backend_type, "peers": peers}
    kept = {
        k: _url(v, this_host) if isinstance(v, str) and "://" in v else v
        for k, v in options.items()
        if not any(s in k.lower() for s in _SECRET_KEYS)
    }
    return {"type": backend_type, "options": kept}


def medium_name(
    name: str, backend_type: str, options: Mapping[str, Any], this_host: str | None = None
) -> str:
    """The ``medium`` of a tier other engines may read: ``<name>@<id>``, ``id`` the first 12 hex
    digits of the SHA-256 of :func:`store_location` (``this_host``: default this host's name)."""
    location = store_location(backend_type, options, this_host or socket.gethostname())
    digest = hashlib.sha256(json.dumps(location, sort_keys=True, default=str).encode()).hexdigest()
    return f"{name}@{digest[:12]}"


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
