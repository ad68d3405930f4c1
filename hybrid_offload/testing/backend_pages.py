"""Page keys and page bytes for backend tests: well formed, deterministic, self-checking.

Pure Python (no pytest): the contract suite (:mod:`.backend_contract`), the backends' own tests
and the child processes those tests start all build their pages here.
"""

from __future__ import annotations

import hashlib
import random

__all__ = ["check_versioned", "key", "page", "versioned_page"]


def key(i: int, namespace: int = 0x5EED0001) -> str:
    """A well-formed page key; different ``i`` spread over directories/slots."""
    digest = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).hexdigest()
    return f"{namespace:08x}-{digest}"


def page(seed: int, size: int) -> bytes:
    """Deterministic pseudo-random bytes."""
    return random.Random(seed).randbytes(size)


def versioned_page(i: int, version: int) -> bytes:
    """A page that names its key index and version, so a torn or mixed-up read is detectable."""
    size = 64 + (i * 7919 + version * 104729) % 2500
    header = f"{i:06d}:{version:06d}:".encode()
    return header + random.Random(i * 1_000_003 + version).randbytes(size - len(header))


def check_versioned(i: int, data: bytes) -> None:
    """Fail unless ``data`` is a whole :func:`versioned_page` of key index ``i``."""
    assert data == versioned_page(i, int(data[7:13])), f"page {i} corrupt or of another key"
