"""Page keys and page bytes for backend tests: well formed, deterministic, self-checking.

Pure Python (no pytest): the contract suite (:mod:`.backend_contract`), the backends' own tests
and the child processes those tests start all build their pages here.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

__all__ = ["assert_pages", "check_versioned", "key", "page", "versioned_page"]


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
    try:
        version = int(data[7:13])
    except ValueError:
        raise AssertionError(f"page {i} corrupt: its header {bytes(data[:14])!r} names no version") from None
    assert_pages(data, versioned_page(i, version), f"page {i}")


Page = bytes | None


def assert_pages(got: Page | Sequence[Page], want: Page | Sequence[Page], what: str = "pages") -> None:
    """Fail unless ``got == want``, saying where they first differ in a line, not a diff.

    Pages are compared here rather than in a bare ``assert``: pytest diffs the reprs of unequal
    bytes, which takes minutes for pages of a few hundred KiB, and longer where ``CI`` is set
    (no truncation there).
    """
    if got == want:
        return
    if isinstance(got, list) and isinstance(want, list):
        if len(got) != len(want):
            raise AssertionError(f"{what}: {len(got)} answers, expected {len(want)}")
        i = next(n for n, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        wrong = sum(a != b for a, b in zip(got, want, strict=True))
        first = _differ(got[i], want[i], f"[{i}]")
        raise AssertionError(f"{what}: {wrong} of {len(want)} differ; first: {first}")
    raise AssertionError(f"{what}: " + _differ(got, want, "it"))


def _differ(got: object, want: object, label: str) -> str:
    if not isinstance(got, bytes | bytearray) or not isinstance(want, bytes | bytearray):
        show = [v if not isinstance(v, bytes | bytearray) else f"{len(v)} bytes" for v in (got, want)]
        return f"{label} is {show[0]}, expected {show[1]}"
    if len(got) != len(want):
        return f"{label} has {len(got)} bytes, expected {len(want)}"
    at = next(n for n, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    got_hex, want_hex = bytes(got[at : at + 8]).hex(), bytes(want[at : at + 8]).hex()
    return f"{label} differs from byte {at} of {len(want)}: {got_hex} != {want_hex}"
