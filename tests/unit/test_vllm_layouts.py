"""testing.vllm_layouts describes vLLM 0.32's GPU KV cache: the views it allocates are the views
vLLM's own ``get_kv_cache_config_from_groups`` + ``allocate_kv_cache`` make (same shapes, dtypes,
strides and offsets into one buffer), for a hybrid model in every layout vLLM gives it, bf16
and fp8 KV; and K/V sit where vLLM's GPU attention backends read them."""

from __future__ import annotations

import types

import pytest
import torch

from hybrid_offload.engine.kv_layout import AttentionGroupLayout, build_layouts
from hybrid_offload.testing.datapath import HybridShape, model_spec
from hybrid_offload.testing.vllm_layouts import LAYOUTS, allocate

SHAPE = HybridShape(attn_layers=2, kv_heads=2, head_size=64, gdn_layers=4, k_heads=2, v_heads=4,
                    head_k=16, head_v=32, group_layers=2)  # fmt: skip
NUM_BLOCKS = 7


def vllm_views(spec, layout_name: str) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[layout_name]
    groups = []
    for g in spec.groups:
        if g.is_attention:
            kv = FullAttentionSpec(block_size=g.block_size, num_kv_heads=g.num_kv_heads,
                                   head_size=g.head_size, dtype=getattr(torch, g.dtype))  # fmt: skip
        else:
            kv = MambaSpec(shapes=g.state_shapes, dtypes=tuple(getattr(torch, d) for d in g.state_dtypes),
                           block_size=g.block_size, page_size_padded=g.page_bytes)  # fmt: skip
        groups.append(KVCacheGroupSpec(list(g.layer_names), kv))
    cache = types.SimpleNamespace(num_gpu_blocks_override=NUM_BLOCKS, prefix_cache_retention_interval=None,
                                  get_resolved_kv_cache_layout=lambda: layout)  # fmt: skip
    attention = types.SimpleNamespace(hisparse_config=None)
    config = types.SimpleNamespace(cache_config=cache, attention_config=attention)
    kv_config = get_kv_cache_config_from_groups(config, groups, 1 << 34)  # type: ignore[arg-type]
    assert kv_config.num_blocks == NUM_BLOCKS
    return allocate_kv_cache(kv_config, torch.device("cpu"), layout)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "uint8"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLHNC", "BLNHC"])
def test_views_are_the_ones_vllm_allocates(layout: str, kv_dtype: str) -> None:
    spec = model_spec(HybridShape(**{**SHAPE.__dict__, "kv_dtype": kv_dtype}), NUM_BLOCKS)
    raw, ours = allocate(spec.groups, NUM_BLOCKS, layout)
    theirs = vllm_views(spec, layout)
    assert ours.keys() == theirs.keys()
    base = next(iter(theirs.values())).untyped_storage().data_ptr()
    for name, view in ours.items():
        other = theirs[name]
        assert (view.shape, view.stride(), view.dtype) == (other.shape, other.stride(), other.dtype), name
        assert view.data_ptr() - raw.data_ptr() == other.data_ptr() - base, name
    assert raw.numel() == next(iter(theirs.values())).untyped_storage().nbytes()


def test_every_layout_of_vllm_is_described() -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert {m.name: m.value for m in KVCacheLayout} == LAYOUTS


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_k_and_v_are_where_the_gpu_backends_split_them(layout: str) -> None:
    """FLASH_ATTN and TRITON_ATTN read K and V as ``kv_cache.transpose(1, 2).split(head_size,
    -1)`` (flash_attn.py, triton_attn.py in vLLM 0.32): the layout's views are those."""
    spec = model_spec(SHAPE, NUM_BLOCKS)
    _, views = allocate(spec.groups, NUM_BLOCKS, layout)
    layout_of = build_layouts(spec.groups, views, NUM_BLOCKS, "logical")[0]
    assert isinstance(layout_of, AttentionGroupLayout) and layout_of.views is not None
    for name, (k, v) in zip(spec.groups[0].layer_names, layout_of.views, strict=True):
        key, value = views[name].transpose(1, 2).split(SHAPE.head_size, dim=-1)
        for ours, theirs in ((k, key), (v, value)):
            assert ours.shape == theirs.shape and ours.stride() == theirs.stride()
            assert ours.data_ptr() == theirs.data_ptr()
