"""vLLM's prompt block hashes, recomputed without vLLM: the router hashes a prompt as the engine
did, to find the blocks its KV events name. Pure functions.

vLLM 0.32 (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``, ``init_none_hash``,
``get_request_block_hasher``) hashes a request every ``hash_block_size`` tokens, each hash
chained over the whole prefix::

    h_i = H((h_{i-1} or NONE_HASH, tuple(tokens of block i), extra_keys))    NONE_HASH = H(seed)

``H`` is the engine's ``prefix_caching_hash_algo`` (``vllm/utils/hashing.py``): ``sha256``
(SHA-256 of ``pickle.dumps(obj, HIGHEST_PROTOCOL)``, the default), ``sha256_cbor`` (SHA-256 of
canonical CBOR), ``xxhash`` / ``xxhash_cbor`` (xxh3-128 of the same). The seed is the engine's
``PYTHONHASHSEED`` when it has one, else ``"vllm-none-hash"`` for the sha256 algorithms and
random bytes per process for the xxhash ones: those are reproducible only with the engine's
``PYTHONHASHSEED`` (``seed``), and refused without it.

Only full blocks are hashed (a prompt's partial tail has no hash). Requests with extra keys (a
LoRA adapter, multimodal inputs, a ``cache_salt``, prompt embeddings) hash differently: the
router never matches them (it passes ``extra_keys = None``). ``pickle`` only serialises the
tuple to hash; nothing is ever unpickled.

Events carry a hash as vLLM's ``maybe_convert_block_hash`` does: the low 64 bits of the
big-endian digest as an int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default), else the
digest bytes (:func:`hybrid_offload.core.kv_events.external_hash`, exported here as ``external``).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from hybrid_offload.core.kv_events import external_hash

#: vLLM's seed of the first block's parent for sha256 algorithms without PYTHONHASHSEED
DEFAULT_SEED = "vllm-none-hash"


class HashAlgoError(ValueError):
    """An algorithm (or algorithm without seed) this module cannot reproduce."""


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    import cbor2  # vLLM's dependency; only the *_cbor algorithms need it

    return cbor2.dumps(obj, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(data)


#: algo -> (serialiser, digest); xxhash ones need a seed
_ALGOS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    "sha256": (_pickled, _sha256),
    "sha256_cbor": (_cbor, _sha256),
    "xxhash": (_pickled, _xxh3_128),
    "xxhash_cbor": (_cbor, _xxh3_128),
}
_SEEDED_ONLY = frozenset({"xxhash", "xxhash_cbor"})


def hash_function(algo: str, seed: str | None = None) -> Callable[[Any], bytes]:
    """vLLM's ``prefix_caching_hash_algo`` ``algo`` as ``obj -> digest``; raises
    :class:`HashAlgoError` for an unknown algorithm, or an xxhash one without ``seed``."""
    if algo not in _ALGOS:
        raise HashAlgoError(f"unknown prefix_caching_hash_algo {algo!r}; known: {sorted(_ALGOS)}")
    if algo in _SEEDED_ONLY and seed is None:
        raise HashAlgoError(
            f"prefix_caching_hash_algo {algo!r} is seeded randomly per engine process unless the "
            "engine runs with PYTHONHASHSEED: pass that value as seed, or run the engine with "
            "sha256 / sha256_cbor"
        )
    serialise, digest = _ALGOS[algo]
    return lambda obj: digest(serialise(obj))


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """vLLM's ``NONE_HASH``: the parent of a prompt's first block."""
    return hash_function(algo, seed)(DEFAULT_SEED if seed is None else seed)


def block_hashes(
    tokens: Sequence[int], hash_block_size: int, algo: str = "sha256", seed: str | None = None
) -> list[bytes]:
    """The engine's hashes of ``tokens``' full blocks of ``hash_block_size`` tokens: index ``i``
    names the prefix ``tokens[: (i + 1) * hash_block_size]``. ``seed``: the engine's
    ``PYTHONHASHSEED`` (None: it has none)."""
    if hash_block_size <= 0:
        raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
    fn = hash_function(algo, seed)
    parent = fn(DEFAULT_SEED if seed is None else seed)
    out: list[bytes] = []
    for start in range(0, len(tokens) - hash_block_size + 1, hash_block_size):
        # map(int): numpy integers pickle differently from the engine's Python ints
        parent = fn((parent, tuple(map(int, tokens[start : start + hash_block_size])), None))
        out.append(parent)
    return out


#: a digest as events carry it (the one implementation: :func:`~hybrid_offload.core.kv_events.external_hash`)
external = external_hash
