"""The torch twin of :func:`hybrid_offload.core.checksum.fold64`: page checksums where the
pages are, on the GPU after the copy (or on the CPU, for the tests that prove the twins agree).

Worker side; torch alone. int64 arithmetic wraps in torch on every device, so the bits are
those of the uint64 sums of the host version. Work is enqueued on the current stream; memory
beyond the result is bounded by :data:`SCRATCH_ELEMENTS` products at a time, plus the weight
table (8 bytes per word of the longest payload, cached per device).
"""

from __future__ import annotations

import threading

import torch

from hybrid_offload.core.checksum import weights

__all__ = ["SCRATCH_ELEMENTS", "fold64_rows"]

#: products held at once (int64): 32 MiB of scratch per call at most, besides the rows
SCRATCH_ELEMENTS = 1 << 22

_lock = threading.Lock()
_tables: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """The first ``n`` weights as int64 on ``device`` (cached, grown as needed)."""
    table = _tables.get(device)
    if table is None or table.numel() < n:
        with _lock:
            table = _tables.get(device)
            if table is None or table.numel() < n:
                host = weights(max(n, 1 << 12)).view("<i8")
                table = torch.from_numpy(host.copy()).to(device)  # a blocking copy: there when used
                if device in _tables:  # another stream may still read the old table: never freed
                    _retired.append(_tables[device])
                _tables[device] = table
    return table[:n]


def fold64_rows(rows: torch.Tensor) -> torch.Tensor:
    """The checksum of every row of ``rows`` (a ``(n, nbytes)`` uint8 tensor whose rows start
    8-byte aligned: row stride and offset multiples of 8) as an int64 tensor of ``n`` on the
    rows' device (the uint64 value's bits)."""
    if rows.dim() != 2 or rows.dtype != torch.uint8:
        raise ValueError("fold64_rows: expected a 2-D uint8 tensor")
    n, nbytes = rows.shape
    words, tail = divmod(nbytes, 8)
    w = _weights(words + 1, rows.device)
    out = torch.zeros(n, dtype=torch.int64, device=rows.device)
    if n == 0:
        return out
    if words:
        if rows.stride(1) != 1 or rows.stride(0) % 8 or rows.storage_offset() % 8:
            raise ValueError("fold64_rows: rows must start 8-byte aligned")
        x = rows[:, : words * 8].view(torch.int64)
        if words >= SCRATCH_ELEMENTS:  # one long row at a time, in pieces
            for i in range(n):
                for start in range(0, words, SCRATCH_ELEMENTS):
                    part = x[i, start : start + SCRATCH_ELEMENTS]
                    out[i] += (part * w[start : start + part.numel()]).sum()
        else:
            step = max(1, SCRATCH_ELEMENTS // words)
            for start in range(0, n, step):
                out[start : start + step] += (x[start : start + step] * w[:words]).sum(dim=1)
    if tail:
        shifts = torch.arange(tail, device=rows.device, dtype=torch.int64) * 8
        last = (rows[:, words * 8 :].to(torch.int64) << shifts).sum(dim=1)
        out += last * w[words]
    return out
