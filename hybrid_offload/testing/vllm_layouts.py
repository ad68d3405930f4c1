"""vLLM 0.32's KV cache memory layouts, as its GPU model runner allocates them; torch alone.

vLLM 0.32 allocates one int8 buffer for the whole model and gives every layer a 4-D view of
it, ``[blocks, heads, states, content bytes]`` cast to the layer's dtype (RFC #42082,
``vllm/v1/kv_cache_interface.py``: ``compute_layout_strides``, ``create_kv_cache_views``;
``vllm/v1/core/kv_cache_utils.py``: ``get_kv_cache_config_from_groups``):

* attention layers: ``[blocks, kv_heads, block_size, 2 * head_size]`` in the KV dtype (uint8
  for fp8 KV, whose scales are per-layer scalars outside the cache), K in the first
  ``head_size`` of the last axis and V in the second, on every NVIDIA backend (FLASH_ATTN,
  TRITON_ATTN, FLASHINFER);
* Mamba/GDN/short-conv layers: int8 ``[blocks, 1, 1, state_bytes]``, the layer's state tensors
  packed in order at the start of each (padded) page;
* the physical order is one :data:`LAYOUTS` entry, a permutation of the logical
  ``[L, B, H, N, C]``; groups alias each other from byte 0 (a block id belongs to one group at
  a time). GPU engines default to ``LBNHC`` (FlashInfer's NHD); ``BL..`` layouts put one block
  of every layer of a group in one run.

:func:`allocate` builds exactly those views (the tests compare them with vLLM's functions
where the CPU build imports them), so the data path is tested on every layout without vLLM
(:mod:`.datapath`). Test-harness code: the product addresses such views through their strides
(:mod:`hybrid_offload.engine.kv_layout`) and allocates nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hybrid_offload.core.spec import GroupSpec

__all__ = ["LAYOUTS", "allocate", "layout_strides"]

#: vLLM's ``KVCacheLayout`` members: logical axis (L, B, H, N, C) in physical order
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
_L, _B = 0, 1


def _order(layout: str) -> tuple[int, ...]:
    try:
        return LAYOUTS[layout]
    except KeyError:
        raise ValueError(f"unknown KV cache layout {layout!r}; vLLM 0.32 has {sorted(LAYOUTS)}") from None


def _shape_bytes(group: GroupSpec, num_blocks: int) -> tuple[int, int, int, int]:
    """The logical ``(B, H, N, C bytes)`` of one layer of ``group``."""
    if group.is_attention:
        itemsize = getattr(torch, group.dtype).itemsize
        content = (group.head_size + group.head_size_v) * itemsize
        return num_blocks, group.num_kv_heads, group.block_size, content
    return num_blocks, 1, 1, group.state_bytes


def _page(group: GroupSpec) -> int:
    """Bytes of one layer's block, unpadded."""
    return math.prod(_shape_bytes(group, 1)[1:])


def layout_strides(
    shape: Sequence[int], layout: str, padded_page: int | None = None,
    fixed: Sequence[int | None] = (None,) * 5,
) -> tuple[int, ...]:  # fmt: skip
    """Byte strides of logical ``[L, B, H, N, C]`` of ``shape`` in ``layout``
    (``compute_layout_strides``): ``fixed`` strides win; a padded page spaces the pages."""
    order = _order(layout)
    grid_end = max(order.index(_L), order.index(_B)) + 1
    strides = [0] * 5
    current = 1
    for physical, dim in reversed(tuple(enumerate(order))):
        if padded_page is not None and physical == grid_end - 1:
            current = max(current, padded_page)
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return tuple(strides)


def bytes_per_block(groups: Sequence[GroupSpec], layout: str) -> int:
    """The bytes of one block id across the largest group (``_get_kv_cache_bytes_per_block``:
    padded pages; whole blocks of every layer in block-outermost layouts)."""
    return max(len(g.layer_names) * g.page_bytes for g in groups if g.layer_names)


def allocate(
    groups: Sequence[GroupSpec], num_blocks: int, layout: str = "LBNHC", device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One zeroed int8 buffer and the per-layer views vLLM 0.32's GPU runner registers with a
    KV connector, for ``groups`` (padded pages: ``GroupSpec.page_bytes``) in ``layout``."""
    order = _order(layout)
    outermost = order[0] == _B
    per_block = bytes_per_block(groups, layout)
    raw = torch.zeros(per_block * num_blocks, dtype=torch.int8, device=device)
    views: dict[str, torch.Tensor] = {}
    for group in groups:
        if not group.layer_names:
            continue
        shape = (len(group.layer_names), *_shape_bytes(group, num_blocks))
        padded = group.page_bytes if group.page_bytes != _page(group) else None
        if not outermost and padded is not None and not set(order[:2]) == {_L, _B}:
            raise ValueError(f"layout {layout} cannot pad the pages of group {group.index}")
        block_stride = per_block if outermost else padded
        strides = layout_strides(shape, layout, padded, (None, block_stride, None, None, None))
        view = torch.as_strided(raw, shape, strides, raw.storage_offset())
        dtype = getattr(torch, group.dtype) if group.is_attention else torch.int8
        for i, name in enumerate(group.layer_names):
            views[name] = view[i].view(dtype)
    return raw, views
