"""Reading pages for ``hybrid-offload cache``, bounded: memory never grows with the cache or
with what a page claims.

Pages are listed with :meth:`Backend.scan`; a page listed larger than the cap
(``--max-page-bytes``) is never read (:func:`split_too_large`); the others are read with
``get_into`` into buffers of their listed sizes (a page that grew since is a miss), in batches
of at most ``BATCH_PAGES`` pages and ``BATCH_BYTES`` bytes. :func:`read_headers` reads only the
first bytes of each page (:meth:`Backend.get_prefix`: a ranged read where the backend has one).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable, Iterator

from hybrid_offload.backends import Backend, PageInfo
from hybrid_offload.core.model_card import ModelCard, card_problem, decode_card
from hybrid_offload.core.secrets import Secret

__all__ = [
    "BATCH_BYTES",
    "BATCH_PAGES",
    "DEFAULT_MAX_PAGE_BYTES",
    "HEADER_PROBE_BYTES",
    "list_pages",
    "namespace",
    "read_cards",
    "read_headers",
    "read_pages",
    "split_too_large",
]

logger = logging.getLogger(__name__)

BATCH_BYTES = 64 << 20
BATCH_PAGES = 256
#: pages listed larger than this are not read (``--max-page-bytes``)
DEFAULT_MAX_PAGE_BYTES = 1 << 30
#: bytes ``stats`` reads first from each page; a longer header is read again, whole
HEADER_PROBE_BYTES = 4096
#: where the page header stores its length: u32 after the magic (4 bytes) and version (u16)
_HEADER_LEN = struct.Struct("<I")
_HEADER_LEN_OFFSET = 6


def namespace(key: str) -> str:
    return key.partition("-")[0]


def list_pages(backend: Backend, fingerprint: str | None) -> list[PageInfo]:
    """Every page (of ``fingerprint``), sorted by key."""
    return sorted(backend.scan(f"{fingerprint}-" if fingerprint else ""), key=lambda info: info.key)


def split_too_large(infos: Iterable[PageInfo], max_page_bytes: int) -> tuple[list[PageInfo], list[PageInfo]]:
    """(pages listed at most ``max_page_bytes``, the larger ones: never read)."""
    fits: list[PageInfo] = []
    large: list[PageInfo] = []
    for info in infos:
        (fits if info.size <= max_page_bytes else large).append(info)
    return fits, large


def _batches(infos: Iterable[PageInfo]) -> Iterator[list[PageInfo]]:
    """Pages in lists of at most ``BATCH_PAGES`` pages and ``BATCH_BYTES`` listed bytes."""
    batch: list[PageInfo] = []
    size = 0
    for info in infos:
        if batch and (size + info.size > BATCH_BYTES or len(batch) >= BATCH_PAGES):
            yield batch
            batch, size = [], 0
        batch.append(info)
        size += info.size
    if batch:
        yield batch


def read_pages(backend: Backend, infos: Iterable[PageInfo]) -> Iterator[tuple[PageInfo, bytes | None]]:
    """``(info, bytes or None)`` per page, each read into a buffer of its listed size: None if
    it vanished or grew since it was listed. Callers drop pages over the cap first."""
    for batch in _batches(infos):
        logger.debug("reading %d pages from %s", len(batch), backend.name)
        buffers = [bytearray(info.size) for info in batch]
        got = backend.get_into([b.key for b in batch], [memoryview(buf) for buf in buffers])
        for info, buf, n in zip(batch, buffers, got, strict=True):
            yield info, None if n is None else bytes(memoryview(buf)[:n])


def read_headers(backend: Backend, infos: Iterable[PageInfo]) -> Iterator[tuple[PageInfo, bytes | None]]:
    """``(info, the page's first bytes, at least its whole header, or None if it vanished)``
    per page (:meth:`Backend.get_prefix`; a header longer than the probe is read again)."""
    from hybrid_offload.core.page_format import MAX_HEADER_BYTES

    for batch in _batches(infos):
        sizes = [info.size for info in batch]
        got = backend.get_prefix([b.key for b in batch], HEADER_PROBE_BYTES, sizes)
        for info, data in zip(batch, got, strict=True):
            if data is not None and len(data) >= _HEADER_LEN_OFFSET + _HEADER_LEN.size:
                (hlen,) = _HEADER_LEN.unpack_from(data, _HEADER_LEN_OFFSET)
                if len(data) < hlen <= min(info.size, MAX_HEADER_BYTES):
                    data = backend.get_prefix([info.key], hlen, [info.size])[0]
            yield info, data


def read_cards(
    backend: Backend, infos: Iterable[PageInfo], max_page_bytes: int, secret: Secret | None = None
) -> dict[str, ModelCard | None]:
    """Fingerprint -> its model card, or None where the card vanished, is not valid (with the
    cache ``secret``: not signed under it) or is listed larger than ``max_page_bytes`` (not
    read)."""
    key = None if secret is None else secret.subkey("page")
    fits, large = split_too_large(infos, max_page_bytes)
    cards: dict[str, ModelCard | None] = {namespace(info.key): None for info in large}
    for info, data in read_pages(backend, fits):
        ok = data is not None and card_problem(info.key, data, key) is None
        cards[namespace(info.key)] = decode_card(data) if ok and data is not None else None
    return cards
