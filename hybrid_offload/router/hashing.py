"""vLLM's prompt block hashes, recomputed without vLLM (the router hashes a prompt as the
engine did, to find the blocks its events name).

vLLM 0.32 hashes a request every ``hash_block_size`` tokens, each hash chained over the whole
prefix: ``h_i = H((h_{i-1} or NONE_HASH, tuple(tokens_i), extra_keys))`` with ``H`` its
``prefix_caching_hash_algo`` (``sha256``: SHA-256 of the pickled tuple, the default;
``sha256_cbor``: of its canonical CBOR) and ``NONE_HASH = H(seed)``, the seed being
``PYTHONHASHSEED`` when the engine has one, else ``"vllm-none-hash"``. Only full blocks are
hashed. Requests with extra keys (LoRA adapters, multimodal inputs, a ``cache_salt``) hash
differently: their prompts do not match here. pickle only serialises the tuple to hash; nothing
is ever unpickled.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

#: vLLM's seed of the first block's parent when the engine has no PYTHONHASHSEED
DEFAULT_SEED = "vllm-none-hash"


class HashAlgoError(ValueError):
    """An algorithm this module cannot reproduce."""


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


_ALGOS: dict[str, Callable[[Any], bytes]] = {"sha256": _sha256, "sha256_cbor": _sha256_cbor}


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's ``prefix_caching_hash_algo`` ``algo``. The xxhash ones are refused: vLLM seeds
    them per process, so no one else can reproduce them."""
    try:
        return _ALGOS[algo]
    except KeyError:
        raise HashAlgoError(
            f"prefix_caching_hash_algo {algo!r} cannot be reproduced outside the engine; "
            f"use one of {sorted(_ALGOS)}"
        ) from None


def block_hashes(
    tokens: Sequence[int], hash_block_size: int, algo: str = "sha256", seed: str | None = None
) -> list[bytes]:
    """The engine's hashes of ``tokens``' full blocks of ``hash_block_size`` tokens (the one at
    index ``i`` names the prefix ``tokens[: (i + 1) * hash_block_size]``)."""
    if hash_block_size <= 0:
        raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
    fn = hash_function(algo)
    parent = fn(DEFAULT_SEED if seed is None else seed)
    out: list[bytes] = []
    for start in range(0, len(tokens) - hash_block_size + 1, hash_block_size):
        parent = fn((parent, tuple(tokens[start : start + hash_block_size]), None))
        out.append(parent)
    return out
