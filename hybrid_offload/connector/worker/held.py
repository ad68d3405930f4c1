"""Page copies the worker holds until the scheduler commits them under a key.

A copy is held when its key is not known yet (under async scheduling an output chunk whose last
token is not sampled when its step is planned) or when only a request's last one of its kind is
worth storing (the decoding state: a newer one replaces the older). The scheduler side later
sends a commit (the copy is stored under the key it names) or a release (the request's copies
are dropped). Model-runner thread only; the worker budgets :attr:`HeldCopies.nbytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from hybrid_offload.core.planner import Piece


class HoldKey(NamedTuple):
    """What a held copy is kept under: its request, group and chunk index."""

    req_id: str
    group: int
    chunk_index: int


class HeldPiece(NamedTuple):
    """One piece of a held page set and its page buffer (its header not yet sealed)."""

    piece: Piece
    buffer: bytearray | memoryview


#: this rank's pieces of one page set
Pieces = Sequence[HeldPiece]


class HeldCopies:
    """The held copies of every live request, and their total size."""

    def __init__(self) -> None:
        self._copies: dict[HoldKey, Pieces] = {}
        self.nbytes = 0

    def hold(self, key: HoldKey, pieces: Pieces, *, newest_only: bool) -> None:
        """Keep ``pieces`` under ``key`` (replacing a copy there); with ``newest_only`` the
        request's other copies of the same group are dropped."""
        if newest_only:
            for other in [k for k in self._copies if k.req_id == key.req_id and k.group == key.group]:
                self.take(other)
        self.take(key)
        self._copies[key] = pieces
        self.nbytes += sum(len(held.buffer) for held in pieces)

    def take(self, key: HoldKey) -> Pieces | None:
        """Remove and return the copy under ``key`` (None if none is held)."""
        pieces = self._copies.pop(key, None)
        if pieces is not None:
            self.nbytes -= sum(len(held.buffer) for held in pieces)
        return pieces

    def release(self, req_id: str) -> None:
        """Drop every copy of ``req_id``."""
        for key in [k for k in self._copies if k.req_id == req_id]:
            self.take(key)
