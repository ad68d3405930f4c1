"""Rounds of the ``nixl_peer`` client: which bytes move where, and when.

Pure bookkeeping, no I/O. A batch's pages move either straight between the caller's buffers
and the peer's pool, in the few registered regions :func:`direct_regions` finds them in, or
through the client's registered staging buffer: then they are cut into :class:`Piece` s so
that each round fills it at most once (one batched NIXL READ or WRITE per peer per round); a
page larger than the buffer spans rounds.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from . import protocol as p


@dataclass
class Piece:
    """A contiguous part of one page moved in one round."""

    pos: int  # position in the caller's batch
    peer: int
    hello: p.HelloReply
    remote: int  # address in the peer's pool
    view: memoryview  # the caller's bytes (source or destination)
    local: int = 0  # offset in the staging buffer; the view's address when moved directly


def plan_rounds(pieces: list[Piece], staging_bytes: int) -> list[list[Piece]]:
    """Split pieces to fill staging exactly; each round fits in ``staging_bytes``."""
    rounds: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for piece in pieces:
        off, length = 0, piece.view.nbytes
        while off < length:
            take = min(staging_bytes - used, length - off)
            part = Piece(
                piece.pos, piece.peer, piece.hello, piece.remote + off, piece.view[off : off + take], used
            )
            current.append(part)
            used += take
            off += take
            if used == staging_bytes:
                rounds.append(current)
                current, used = [], 0
    if current:
        rounds.append(current)
    return rounds


#: buffers closer than this share a region: every byte between them lies on a memory page one
#: of them is on, so the region is mapped memory
PAGE_GAP = 4096


def direct_regions(spans: list[tuple[int, int]], max_regions: int) -> list[tuple[int, int]] | None:
    """The fewest ``(address, length)`` regions covering ``spans`` (address, length), merging
    spans less than :data:`PAGE_GAP` apart; None when more than ``max_regions`` are needed."""
    regions: list[list[int]] = []
    for start, length in sorted(spans):
        if regions and start - regions[-1][1] < PAGE_GAP:
            regions[-1][1] = max(regions[-1][1], start + length)
            continue
        if len(regions) == max_regions:
            return None
        regions.append([start, start + length])
    return [(start, end - start) for start, end in regions]


def address(view: memoryview) -> int:
    """The address of ``view``'s first byte (a contiguous, non-empty byte view)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:  # read-only
        return int(np.frombuffer(view, np.uint8).ctypes.data)
