"""Views over vLLM's registered KV cache tensors: copy chunks and states out and back in.

Worker side only. Attention layers: vLLM's CPU backend keeps each kernel block as
``[kv_heads][block_size][2 * head_size]`` and, with AMX, in a tiled order that differs per
instruction set. Instead of hard-coding kernel layouts, :func:`_attention_layout` writes
marked K/V through vLLM's own cache-write op once and records where every
``(k|v, token, head, dim)`` element lands. Gathers and scatters then use that index map, so
pages are always ``[token][head][dim]`` whatever the kernel does.

On a GPU (and wherever the format is ``"logical"``) attention tensors are vLLM's logical
``[blocks, kv_heads, block_size, 2 * head_size]`` views (K then V in the last axis), in any
physical order vLLM 0.32 has (:mod:`hybrid_offload.testing.vllm_layouts` builds them for the
tests): copies address them through their strides, which also works for per-layer views into a
cross-layer buffer.

Mamba/GDN layers arrive as int8 page views ``(num_blocks, 1, 1, state_bytes)``; the state
tensors are packed in the spec's order at the start of each block, padding after them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybrid_offload.compat import cpu_attention_isa, cpu_attention_reshape_and_cache
from hybrid_offload.core.spec import GroupSpec

logger = logging.getLogger(__name__)

# bf16 has too few mantissa bits to hold indices: mark with bit patterns in the normal range.
_BF16_MARK_BASE = 0x3F80


def host_to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` (on the host) on ``device``, copied asynchronously on the current stream: from
    pinned memory (an async copy from pageable memory can wait for the stream's earlier
    copies). On the host, ``values`` itself."""
    if device.type == "cpu":
        return values
    return values.pin_memory().to(device, non_blocking=True)


class LayoutError(RuntimeError):
    """A registered KV tensor has a shape or layout we do not know how to address."""


def _marks(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return (values.to(torch.int32) + _BF16_MARK_BASE).to(torch.int16).view(torch.bfloat16)
    if dtype in (torch.float16, torch.float32):
        return values.to(dtype)
    raise LayoutError(f"cannot probe KV layout for dtype {dtype}")


def _unmarks(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return values.view(torch.int16).to(torch.int64) - _BF16_MARK_BASE
    return values.to(torch.int64)


def _probe_cpu_attn(heads: int, block: int, dim: int, dtype: torch.dtype, isa: str) -> torch.Tensor:
    """Element offset within one kernel block for each (kv, token, head, dim), via vLLM's op."""
    reshape_and_cache = cpu_attention_reshape_and_cache()
    coords = torch.stack(
        torch.meshgrid(torch.arange(block), torch.arange(heads), torch.arange(dim), indexing="ij")
    )  # (3, block, heads, dim)
    found = []
    for axis in range(3):
        cache = torch.zeros(1, heads, block, 2 * dim, dtype=dtype)
        key_cache, value_cache = cache.view(1, heads, block * 2, dim).chunk(2, dim=2)
        key = _marks(coords[axis] + 1, dtype)
        value = _marks(coords[axis] + 1 + (1 << 12), dtype)
        reshape_and_cache(
            key, value, key_cache, value_cache, torch.arange(block, dtype=torch.long), isa
        )
        found.append(_unmarks(cache.reshape(-1), dtype))
    is_value = found[0] >= (1 << 12) + 1
    t, h, d = ((f - 1 - is_value.to(torch.int64) * (1 << 12)) for f in found)
    perm = torch.full((2, block, heads, dim), -1, dtype=torch.int64)
    perm[is_value.to(torch.int64), t, h, d] = torch.arange(t.numel())
    if (perm < 0).any():
        raise LayoutError(f"CPU attention layout probe (isa={isa}) did not map every element")
    return perm


def _flat_layout(heads: int, block: int, dim: int) -> torch.Tensor:
    """Layout ``[kv][block][heads][dim]`` per block (vLLM's standard NHD layout)."""
    return torch.arange(2 * block * heads * dim, dtype=torch.int64).view(2, block, heads, dim)


@dataclass(frozen=True)
class TokenIndex:
    """Where some tokens of a request live in an attention group's cache: per token its kernel
    block and its slot in it (any shape, the same for both), and this rank's KV heads."""

    kblocks: torch.Tensor
    slots: torch.Tensor
    heads: slice


@dataclass(frozen=True)
class CacheWrites:
    """vLLM's own CPU cache-write op over one group's layers: what the model runs to write K/V,
    and what :func:`_probe_cpu_attn` learnt the layout from, so its writes land exactly where
    the probed map says. Per layer, its K and V caches as the op takes them
    (``[kernel blocks, heads, kernel_block, head_size]`` views)."""

    caches: list[tuple[torch.Tensor, torch.Tensor]]
    isa: str

    def subset(self, positions: Sequence[int]) -> CacheWrites:
        return CacheWrites([self.caches[i] for i in positions], self.isa)


@dataclass
class AttentionGroupLayout:
    """Addressing for one attention group: every layer shares block table and layout.

    Where the probed layout is strided for K and for V (offset = base + token * a + head * b
    + dim * c inside a kernel block; vLLM's NHD layout and the CPU "vec" kernel, which keeps K
    transposed), copies index tokens only and move each token's (heads, dim) slice through a
    strided view (``views``): no index per element. Other layouts (AMX tiles) are written with
    vLLM's own cache-write op where it is there (``writes``) and otherwise, and for gathers,
    copied element by element through ``perm``.
    """

    group: GroupSpec
    layers: list[torch.Tensor]  # each flattened to 1-D over the whole cache
    perm: torch.Tensor  # (2, kernel_block, heads, dim) -> offset in a kernel block
    kernel_block: int
    kernel_blocks_per_block: int
    block_elems: int
    #: per layer, K and V as (kernel blocks, kernel_block, heads, dim) views; None: not strided
    views: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    #: vLLM's cache-write op over these layers, where the layout is its CPU kernels' (used
    #: where the layout is not strided)
    writes: CacheWrites | None = None

    def subset(self, positions: Sequence[int]) -> AttentionGroupLayout:
        """This layout over the layers at ``positions`` only (a layer part's)."""
        views = None if self.views is None else [self.views[i] for i in positions]
        writes = None if self.writes is None else self.writes.subset(positions)
        layers = [self.layers[i] for i in positions]
        return dataclasses.replace(self, layers=layers, views=views, writes=writes)

    @property
    def scatters_by_token(self) -> bool:
        """Whether :meth:`scatter` moves whole tokens (a strided view or vLLM's cache-write op),
        so that many pages' tokens go in one call, rather than element by element."""
        return self.views is not None or self.writes is not None

    @functools.cached_property
    def stacked(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V of every layer as one ``(kernel blocks, kernel_block, layers, heads, dim)``
        view each, where the layers' views are equally spaced in one buffer (vLLM allocates a
        group's layers so): one copy moves a token's K (or V) of every layer. None otherwise."""
        if self.views is None:
            return None
        out = []
        for kv in (0, 1):
            views = [v[kv] for v in self.views]
            first = views[0]
            step = views[1].storage_offset() - first.storage_offset() if len(views) > 1 else 0
            storage = first.untyped_storage().data_ptr()
            for i, v in enumerate(views):
                if v.stride() != first.stride() or v.untyped_storage().data_ptr() != storage:
                    return None
                if v.storage_offset() != first.storage_offset() + i * step:
                    return None
            b, t, h, d = first.stride()
            shape = (*first.shape[:2], len(views), *first.shape[2:])
            out.append(first.as_strided(shape, (b, t, step, h, d), first.storage_offset()))
        return out[0], out[1]

    def gather_stacked(self, index: TokenIndex, out: torch.Tensor) -> None:
        """Copy K/V at ``index`` of every layer into ``out`` (shape (2, *index shape, layers,
        heads, dim)); needs :attr:`stacked`."""
        assert self.stacked is not None
        at = (index.kblocks, index.slots)
        for kv, view in enumerate(self.stacked):
            out[kv].copy_(view[:, :, :, index.heads][at])

    def scatter_stacked(self, index: TokenIndex, src: torch.Tensor) -> None:
        """Copy ``src`` (shape (2, *index shape, layers, heads, dim)) into every layer at
        ``index``; needs :attr:`stacked`."""
        assert self.stacked is not None
        at = (index.kblocks, index.slots)
        for kv, view in enumerate(self.stacked):
            view[:, :, :, index.heads].index_put_(at, src[kv])

    def token_index(
        self, block_ids: list[int], first_token: int, num_tokens: int, heads: slice = slice(None)
    ) -> TokenIndex:
        """Tokens ``[first_token, first_token + num_tokens)`` of a request with this block table,
        this rank's KV heads ``heads``; what :meth:`gather`, :meth:`scatter`, :meth:`zero` take."""
        pos = torch.arange(first_token, first_token + num_tokens)
        bs = self.group.block_size
        table = torch.as_tensor(block_ids, dtype=torch.int64)
        kblock = table[pos // bs] * self.kernel_blocks_per_block + (pos % bs) // self.kernel_block
        return TokenIndex(self._on_device(kblock), self._on_device(pos % self.kernel_block), heads)

    def _elements(self, index: TokenIndex) -> torch.Tensor:
        """Flat element offsets (2, tokens, h, D) of ``index``'s tokens, in index order."""
        kblocks, slots = index.kblocks.reshape(-1), index.slots.reshape(-1)
        offset = self.perm[:, :, index.heads][:, slots]
        return (kblocks.view(1, -1, 1, 1) * self.block_elems + offset).reshape(-1)

    def token_rows(
        self, pages: Sequence[tuple[Sequence[int], int]], num_tokens: int, heads: slice = slice(None),
        host: bool = False,
    ) -> TokenIndex:  # fmt: skip
        """As :meth:`token_index` for several (block table, first token) at once, ``num_tokens``
        each: ``kblocks`` and ``slots`` are (pages, num_tokens). ``host``: left on the host
        (:meth:`on_device` moves it later)."""
        bs = self.group.block_size
        firsts = torch.tensor([first for _, first in pages], dtype=torch.int64)
        pos = firsts[:, None] + torch.arange(num_tokens)
        width = (int(firsts.max()) + num_tokens - 1) // bs + 1
        if width == 1:  # every page inside one block (the chunk divides the block)
            table = torch.tensor([ids[0] for ids, _ in pages], dtype=torch.int64).view(-1, 1)
        else:
            table = torch.tensor(
                [(*ids[:width], *(0,) * (width - len(ids[:width]))) for ids, _ in pages], dtype=torch.int64
            )
        kblock = table.gather(1, pos // bs) * self.kernel_blocks_per_block + (pos % bs) // self.kernel_block
        index = TokenIndex(kblock, pos % self.kernel_block, heads)
        return index if host else self.on_device(index)

    def on_device(self, index: TokenIndex) -> TokenIndex:
        """``index`` (built on the host) where the KV cache is."""
        kblocks, slots = self._on_device(index.kblocks), self._on_device(index.slots)
        return dataclasses.replace(index, kblocks=kblocks, slots=slots)

    def _on_device(self, index: torch.Tensor) -> torch.Tensor:
        """An index built on the host, where the KV cache is (ordered on the current stream)."""
        return host_to_device(index, self.layers[0].device)

    def gather(self, index: TokenIndex, out: list[torch.Tensor]) -> None:
        """Copy K/V at ``index`` of every layer into ``out[layer]`` (shape (2, T, h, D);
        contiguous where the layout is not strided)."""
        if self.views is None:
            flat_index = self._elements(index)
            for layer, dst in zip(self.layers, out, strict=True):
                torch.index_select(layer, 0, flat_index, out=dst.view(-1))
            return
        at = (index.kblocks, index.slots)
        for kv_views, dst in zip(self.views, out, strict=True):
            for kv, view in enumerate(kv_views):
                dst[kv].copy_(view[:, :, index.heads][at])

    def scatter(self, index: TokenIndex, src: list[torch.Tensor]) -> None:
        """Copy ``src[layer]`` (shape (2, *index shape, h, D)) into every layer at ``index``."""
        if self.views is None and self.writes is not None:
            self._write(index, src, self.writes)
            return
        if self.views is None:
            flat_index = self._elements(index)
            for layer, data in zip(self.layers, src, strict=True):
                layer.index_copy_(0, flat_index, data.reshape(-1))
            return
        at = (index.kblocks, index.slots)
        for kv_views, data in zip(self.views, src, strict=True):
            for kv, view in enumerate(kv_views):
                view[:, :, index.heads].index_put_(at, data[kv])

    def _write(self, index: TokenIndex, src: list[torch.Tensor], writes: CacheWrites) -> None:
        """:meth:`scatter` through vLLM's cache-write op: one call per layer, K and V together."""
        write = cpu_attention_reshape_and_cache()
        slots = (index.kblocks * self.kernel_block + index.slots).reshape(-1)
        for (key_cache, value_cache), data in zip(writes.caches, src, strict=True):
            key, value = (_tokens(data[kv]) for kv in (0, 1))
            write(key, value, key_cache[:, index.heads], value_cache[:, index.heads], slots, writes.isa)

    def zero(self, index: TokenIndex) -> None:
        """Zero K/V at ``index`` in every layer."""
        if self.views is None:
            flat_index = self._elements(index)
            for layer in self.layers:
                layer.index_fill_(0, flat_index, 0)
            return
        at = (index.kblocks, index.slots)
        for kv_views in self.views:
            for view in kv_views:
                view[:, :, index.heads].index_put_(at, torch.zeros((), dtype=view.dtype, device=view.device))


def _tokens(values: torch.Tensor) -> torch.Tensor:
    """``values`` (..., tokens, heads, head_size) as (tokens, heads, head_size) with the head
    size contiguous, as vLLM's cache-write op reads it (a view where the strides allow)."""
    flat = values.reshape(-1, *values.shape[-2:])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _strides(perm: torch.Tensor) -> list[tuple[int, int, int, int]] | None:
    """Per K and V, (offset, token, head, dim) strides in elements when ``perm`` (2, kblock,
    heads, dim) is strided for both; else None."""
    out: list[tuple[int, int, int, int]] = []
    for part in perm:
        base = int(part[0, 0, 0])
        steps = [int(part.select(axis, 1).flatten()[0]) - base if n > 1 else 0
                 for axis, n in enumerate(part.shape)]  # fmt: skip
        grid = torch.meshgrid(*(torch.arange(n) for n in part.shape), indexing="ij")
        expected = torch.full_like(part, base)
        for g, st in zip(grid, steps, strict=True):
            expected += g * st
        if len(steps) != 3 or not torch.equal(part, expected):
            return None
        out.append((base, steps[0], steps[1], steps[2]))
    return out


@dataclass
class MambaGroupLayout:
    """Addressing for one Mamba/GDN group: per layer, the unpadded state bytes of a block."""

    group: GroupSpec
    layers: list[torch.Tensor]  # each (num_blocks, state_bytes) uint8 views; copies: page_codec

    def subset(self, positions: Sequence[int]) -> MambaGroupLayout:
        """This layout over the layers at ``positions`` only (a layer part's)."""
        return MambaGroupLayout(self.group, [self.layers[i] for i in positions])


def _logical_attention_layout(
    group: GroupSpec, tensors: list[torch.Tensor], num_blocks: int
) -> AttentionGroupLayout:
    """vLLM's logical ``[blocks, kv_heads, block_size, 2 * head_size]`` per-layer views, any
    strides: K and V are strided views of them, no probe and no contiguity needed."""
    first = tensors[0]
    heads, dim = group.num_kv_heads, group.head_size
    if first.dim() != 4 or first.shape[1] != heads or first.shape[3] != dim + group.head_size_v:
        raise LayoutError(
            f"group {group.index}: attention KV tensor shape {tuple(first.shape)} is not vLLM's "
            f"[blocks, {heads} kv heads, block size, {dim + group.head_size_v}]"
        )
    kblock = first.shape[2]
    if first.shape[0] % num_blocks or group.block_size % kblock:
        raise LayoutError(
            f"group {group.index}: {first.shape[0]} kernel blocks of {kblock} tokens do not tile "
            f"{num_blocks} blocks of {group.block_size} tokens"
        )
    for t in tensors:
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            raise LayoutError(f"group {group.index}: layers' KV views differ in shape, strides or dtype")
    views = [(t[..., :dim].transpose(1, 2), t[..., dim:].transpose(1, 2)) for t in tensors]
    return AttentionGroupLayout(
        group=group,
        layers=list(tensors),
        perm=torch.empty(0, dtype=torch.int64),
        kernel_block=kblock,
        kernel_blocks_per_block=first.shape[0] // num_blocks,
        block_elems=first[0].numel(),
        views=views,
    )


def _attention_layout(group: GroupSpec, tensors: list[torch.Tensor], num_blocks: int) -> AttentionGroupLayout:
    first = tensors[0]
    heads, dim = group.num_kv_heads, group.head_size
    isa = None
    if first.dim() == 4 and first.shape[1] == heads and first.shape[3] == 2 * dim:
        kblock = first.shape[2]
        isa = cpu_attention_isa(first.dtype, kblock, dim)
        perm = _probe_cpu_attn(heads, kblock, dim, first.dtype, isa)
    elif first.dim() == 5 and first.shape[1] == 2 and first.shape[3:] == (heads, dim):
        kblock = first.shape[2]
        perm = _flat_layout(heads, kblock, dim)
    else:
        raise LayoutError(
            f"group {group.index}: attention KV tensor shape {tuple(first.shape)} is not a known "
            f"layout for {heads} kv heads of size {dim}"
        )
    if first.shape[0] % num_blocks or group.block_size % kblock:
        raise LayoutError(
            f"group {group.index}: {first.shape[0]} kernel blocks of {kblock} tokens do not tile "
            f"{num_blocks} blocks of {group.block_size} tokens"
        )
    for t in tensors:
        if not t.is_contiguous():
            raise LayoutError(f"group {group.index}: KV tensor is not contiguous")
    block_elems = first[0].numel()
    strides = _strides(perm)
    views = None
    if strides is not None:
        shape = (first.shape[0], kblock, heads, dim)
        views = [
            tuple(t.as_strided(shape, (block_elems, st, sh, sd), t.storage_offset() + off)
                  for off, st, sh, sd in strides)
            for t in tensors
        ]
    writes = None
    if isa is not None:
        n = first.shape[0]
        halves = [t.view(n, heads, 2 * kblock, dim).chunk(2, dim=2) for t in tensors]
        writes = CacheWrites([(k, v) for k, v in halves], isa)
    logger.debug("group %d: attention copies %s", group.index,
                 "by token" if views else "with vLLM's cache-write op" if writes else "by element")
    return AttentionGroupLayout(
        group=group,
        layers=[t.view(-1) for t in tensors],
        perm=perm,
        kernel_block=kblock,
        kernel_blocks_per_block=first.shape[0] // num_blocks,
        block_elems=block_elems,
        views=views,  # type: ignore[arg-type]
        writes=writes,
    )


def _mamba_layout(group: GroupSpec, tensors: list[torch.Tensor]) -> MambaGroupLayout:
    views = []
    for t in tensors:
        if t.dtype not in (torch.int8, torch.uint8) or t.shape[-1] < group.state_bytes:
            raise LayoutError(
                f"group {group.index}: Mamba page view {tuple(t.shape)} {t.dtype} cannot hold "
                f"{group.state_bytes} state bytes"
            )
        view = t.view(torch.uint8).flatten(1)[:, : group.state_bytes]
        if view.data_ptr() != t.data_ptr():
            raise LayoutError(f"group {group.index}: Mamba page view cannot be addressed in place")
        views.append(view)
    return MambaGroupLayout(group=group, layers=views)


def build_layouts(
    groups: tuple[GroupSpec, ...], kv_caches: dict[str, torch.Tensor], num_blocks: int,
    attention_format: str | None = None,
) -> dict[int, AttentionGroupLayout | MambaGroupLayout]:  # fmt: skip
    """Layouts per group index from the tensors vLLM passes to ``register_kv_caches``.

    ``attention_format``: ``"cpu"`` (vLLM's CPU attention kernels, which keep their own order
    inside a block: probed) or ``"logical"`` (vLLM's logical views, as on GPUs); default: by
    the tensors' device."""
    layouts: dict[int, AttentionGroupLayout | MambaGroupLayout] = {}
    for group in groups:
        if not group.layer_names:
            continue  # a pipeline stage holding no layer of this group
        missing = [n for n in group.layer_names if n not in kv_caches]
        if missing:
            raise LayoutError(f"group {group.index}: no KV tensor registered for layers {missing}")
        tensors = [kv_caches[n] for n in group.layer_names]
        if group.is_attention:
            form = attention_format or ("cpu" if tensors[0].device.type == "cpu" else "logical")
            logical = form == "logical"
            build = _logical_attention_layout if logical else _attention_layout
            layouts[group.index] = build(group, tensors, num_blocks)
        else:
            layouts[group.index] = _mamba_layout(group, tensors)
        logger.info("group %d (%s): %d layers addressed", group.index, group.kind.value, len(tensors))
    return layouts
