"""Staging rounds of the ``nixl_peer`` client: which bytes go through the staging buffer when.

Pure bookkeeping, no I/O: a batch's pages are cut into :class:`Piece` s so that each round
fills the client's registered staging buffer at most once (one batched NIXL READ or WRITE per
peer per round); a page larger than the buffer spans rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import protocol as p


@dataclass
class Piece:
    """A contiguous part of one page moved in one round."""

    pos: int  # position in the caller's batch
    peer: int
    hello: p.HelloReply
    remote: int  # address in the peer's pool
    view: memoryview  # the caller's bytes (source or destination)
    staging: int = 0  # offset in the staging buffer


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
