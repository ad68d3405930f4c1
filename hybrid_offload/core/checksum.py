"""fold64: the payload checksum of a page, computable on the host and on a GPU alike.

A page's payload is read as little-endian 64-bit words ``x_j`` (the last word zero-padded
when the length is not a multiple of 8), and::

    fold64 = sum_j x_j * w_j  mod 2**64,    w_j = (2j + 1) * PHI  mod 2**64

Every weight is odd, so changing any one word (any flipped bit or byte) always changes the
sum; other corruption goes unnoticed with probability about 2**-64. It catches corruption,
not forgery (that is the MAC's job, see ``page_format``).

Why not xxh3: a word-wise multiply and sum is what a GPU does at memory speed with two torch
kernels (``hybrid_offload.connector.worker.device_checksum`` is the twin, tested to give the
same value), so a GPU engine checks pages after copying them to the device instead of on the
host; and on the host numpy computes it without holding the GIL (xxhash's binding holds it),
so checking pages does not stall vLLM's threads.

The weights are a table (:func:`weights`) grown to the longest payload seen, shared by every
caller; numpy's ``einsum`` sums the products without a temporary (11-22 GB/s on one core here,
against 5-7 with a multiply and a sum).
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["PHI", "fold64", "fold64_rows", "weights"]

#: the weights' multiplier (2**64 / golden ratio, odd)
PHI = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
#: words per numpy call (8 MiB): ``einsum`` multiplies and sums without a temporary, at memory
#: speed, the GIL released; pieces bound how long a call runs
_PIECE = 1 << 20

_lock = threading.Lock()
_table = np.zeros(0, dtype=np.uint64)


def weights(n: int) -> np.ndarray:
    """The first ``n`` weights (uint64, read-only; the shared table grows to ``n``)."""
    global _table
    table = _table
    if len(table) >= n:
        return table[:n]
    with _lock:
        if len(_table) < n:
            size = max(n, 2 * len(_table), 1 << 12)
            j = np.arange(size, dtype=np.uint64)
            grown = (j * np.uint64(2) + np.uint64(1)) * np.uint64(PHI)
            grown.setflags(write=False)
            _table = grown
        return _table[:n]


def _tail_word(tail: bytes | memoryview) -> int:
    return int.from_bytes(bytes(tail), "little")


def fold64(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """The checksum of ``data`` (any contiguous bytes; numpy releases the GIL while it sums)."""
    view = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else data.reshape(-1).data
    nbytes = view.nbytes
    words = nbytes // 8
    w = weights(words + 1)
    x = np.frombuffer(view, dtype="<u8", count=words)
    total = 0
    for start in range(0, words, _PIECE):
        part = x[start : start + _PIECE]
        total += int(np.einsum("i,i->", part, w[start : start + len(part)]))
    if nbytes % 8:
        total += _tail_word(view[words * 8 :]) * int(w[words])
    return total & _MASK


def fold64_rows(rows: np.ndarray) -> np.ndarray:
    """:func:`fold64` of every row of a ``(n, nbytes)`` uint8 array (uint64, one per row);
    for many short rows (page headers) in a few numpy calls."""
    if rows.ndim != 2 or rows.dtype != np.uint8:
        raise ValueError("fold64_rows: expected a 2-D uint8 array")
    n, nbytes = rows.shape
    words = nbytes // 8
    w = weights(words + 1)
    out = np.zeros(n, dtype=np.uint64)
    if words:
        head = rows[:, : words * 8]
        aligned = head.strides[1] == 1 and head.strides[0] % 8 == 0 and head.ctypes.data % 8 == 0
        x = (head if aligned else np.ascontiguousarray(head)).view("<u8")  # rows read in place
        out += np.einsum("ij,j->i", x, w[:words])
    if nbytes % 8:
        tail = rows[:, words * 8 :].astype(np.uint64)
        shifts = np.arange(nbytes % 8, dtype=np.uint64) * np.uint64(8)
        out += (tail << shifts).sum(axis=1, dtype=np.uint64) * w[words]
    return out
