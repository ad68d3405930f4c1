"""Mamba/GDN state pages as element maps: which elements of a piece's payload are which
elements of vLLM's state blocks.

Worker side. A piece of a state page set holds, per layer of its part, the parts of the state
tensors it covers (conv and SSM, split by TP shard: :mod:`hybrid_offload.core.tp_shards`); vLLM
keeps each layer's states packed at the start of its block (the conv state transposed in DS
engines). Copying them tensor by tensor, run by run and layer by layer is thousands of small
copies per load. A :class:`StateMap` is computed once per (layout, piece, direction) from the
same runs, as two index tensors on the cache's device: payload element -> element of the whole
KV buffer (relative to block 0). A piece's copy for any set of blocks is then one gather and one
scatter, on CPU and GPU alike. Elements are the widest of 8, 4, 2 or 1 bytes that every run and
the buffers' alignment allow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybrid_offload.core.spec import DTYPE_SIZES, GroupSpec, TensorSpec

_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class Run:
    """Copy ``length`` indices along ``axis`` of state tensor ``tensor``: this rank's tensor
    from ``rank_start``, the shard's part ``part`` (its index in the shard's layer parts) from
    ``part_start``. (Attention pieces use it for runs of KV heads: ``tensor`` 0, the head axis.)"""

    tensor: int
    axis: int
    part: int
    part_start: int
    rank_start: int
    length: int


def _offsets(start: int, shape: Sequence[int], itemsize: int) -> torch.Tensor:
    """Byte offset of every element of a C-order tensor at byte ``start``, shaped as it."""
    return (start + torch.arange(math.prod(shape), dtype=torch.int64) * itemsize).view(*shape)


def _bytes(starts: torch.Tensor, itemsize: int) -> torch.Tensor:
    return (starts.reshape(-1, 1) + torch.arange(itemsize, dtype=torch.int64)).flatten()


def byte_map(
    group: GroupSpec, tensors: Sequence[TensorSpec], runs: Sequence[Run], layer_bases: Sequence[int | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload byte, buffer byte) pairs of one piece, ordered by payload byte: ``tensors`` are
    the piece's payload tensors (per layer, in order), ``layer_bases`` each layer's block 0 in
    the buffer (None: a layer in another buffer, left out)."""
    per_layer = len(tensors) // len(layer_bases)
    src, dst, offset = [], [], 0
    for layer, base in enumerate(layer_bases):
        if base is None:
            offset += sum(t.nbytes for t in tensors[layer * per_layer : (layer + 1) * per_layer])
            continue
        parts = []
        for t in tensors[layer * per_layer : (layer + 1) * per_layer]:
            parts.append(_offsets(offset, t.shape, DTYPE_SIZES[t.dtype]))
            offset += t.nbytes
        states, at = [], base
        for i, (shape, dtype) in enumerate(zip(group.state_shapes, group.state_dtypes, strict=True)):
            size = DTYPE_SIZES[dtype]
            ds = i == 0 and group.conv_layout == "DS"  # kept (dim, state_len): a transposed view
            states.append(_offsets(at, shape[::-1], size).t() if ds else _offsets(at, shape, size))
            at += math.prod(shape) * size
        for run in runs:
            size = DTYPE_SIZES[group.state_dtypes[run.tensor]]
            src.append(_bytes(parts[run.part].narrow(run.axis, run.part_start, run.length), size))
            dst.append(_bytes(states[run.tensor].narrow(run.axis, run.rank_start, run.length), size))
    src_all, dst_all = torch.cat(src), torch.cat(dst)
    order = torch.argsort(src_all)
    return src_all[order], dst_all[order]


def _unit(src: torch.Tensor, dst: torch.Tensor, limit: int) -> int:
    """The widest element (bytes, at most ``limit``) both maps move whole and aligned."""
    for unit in (8, 4, 2):
        if unit > limit or src.numel() % unit:
            continue
        s, d = src.view(-1, unit), dst.view(-1, unit)
        step = torch.arange(unit, dtype=torch.int64)
        aligned = bool((s[:, 0] % unit == 0).all() and (d[:, 0] % unit == 0).all())
        if aligned and all(torch.equal(m - m[:, :1], step.expand_as(m)) for m in (s, d)):
            return unit
    return 1


class StateMap:
    """One piece's element maps over a layout's buffer (see the module docstring)."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, buffer: torch.Tensor, block_stride: int,
                 payload_len: int) -> None:  # fmt: skip
        """``src``/``dst``: byte maps (:func:`byte_map`); ``buffer``: the whole KV buffer as
        flat bytes; ``block_stride``: bytes between one block and the next."""
        self.buffer = buffer
        self._maps: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._bytes = (src, dst)
        self.block_stride, self.payload_len = block_stride, payload_len
        limit = math.gcd(block_stride, buffer.numel(), 8)
        self.unit = _unit(src, dst, limit)

    def prepare(self) -> None:
        """Build the maps at the widest element now (see :meth:`_at`)."""
        self._at(self.unit)

    def _at(self, unit: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(buffer element per payload element, payload element per copied element or None
        where the payload is copied whole and in order) at ``unit``-byte elements."""
        known = self._maps.get(unit)
        if known is None:
            src, dst = self._bytes
            s, d = src[::unit] // unit, dst[::unit] // unit
            whole = s.numel() * unit == self.payload_len and torch.equal(s, torch.arange(s.numel()))
            device = self.buffer.device
            known = self._maps[unit] = (d.to(device), None if whole else s.to(device))
        return known

    def _unit_for(self, payload: torch.Tensor) -> int:
        unit = self.unit
        while unit > 1 and (payload.storage_offset() % unit or payload.numel() % unit):
            unit //= 2
        return unit

    def scatter(self, payload: torch.Tensor, blocks: Sequence[int]) -> None:
        """Write ``payload`` (the piece's uint8 payload) into every block of ``blocks``."""
        unit = self._unit_for(payload)
        dst, src = self._at(unit)
        dtype = _UNITS[unit]
        values = payload.view(dtype)
        if src is not None:
            values = values.index_select(0, src)
        buffer, stride = self.buffer.view(dtype), self.block_stride // unit
        for block in blocks:  # one block but in Mamba cache mode "all"
            buffer.index_copy_(0, dst.add(block * stride) if block else dst, values)

    def gather(self, payload: torch.Tensor, block: int) -> None:
        """Copy block ``block``'s states of the piece into ``payload`` (uint8)."""
        unit = self._unit_for(payload)
        dst, src = self._at(unit)
        dtype = _UNITS[unit]
        index = dst + block * (self.block_stride // unit) if block else dst
        out = payload.view(dtype)
        if src is None:
            torch.index_select(self.buffer.view(dtype), 0, index, out=out)
        else:
            out.index_copy_(0, src, self.buffer.view(dtype).index_select(0, index))


def flat_buffer(view: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``view`` as flat uint8 (views' storage offsets index it)."""
    storage = view.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(storage, 0, (storage.nbytes(),), (1,))
