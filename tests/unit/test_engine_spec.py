"""Translation of real vLLM KV cache specs into GroupSpec/ModelSpec, and the fingerprint.

Importing vLLM takes several seconds, so it happens once, in the module-scoped ``vllm_kv``
fixture, and only tests that need real vLLM objects use it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hybrid_offload import FORMAT_VERSION
from hybrid_offload.core import spec as core_spec
from hybrid_offload.core.spec import (
    DTYPE_SIZES,
    GroupKind,
    GroupSpec,
    ModelSpec,
    TensorSpec,
    UnidentifiableModelError,
    compute_fingerprint,
    make_model_spec,
)
from hybrid_offload.engine import model_identity
from hybrid_offload.engine.translate import _group_from_vllm, model_spec_from_vllm

MODEL = {"name": "tiiuae/Falcon-H1-0.5B", "revision": "main", "architectures": ["FalconH1"],
         "hf_config": "0123", "dtype": "bfloat16", "kv_cache_dtype": "auto"}
FALCON_SHAPES = ((3, 288), (4, 64, 16))


@pytest.fixture(scope="module")
def vllm_kv() -> SimpleNamespace:
    """torch plus vLLM's kv_cache_interface, imported once for this module."""
    torch = pytest.importorskip("torch")
    kv = pytest.importorskip("vllm.v1.kv_cache_interface")
    return SimpleNamespace(torch=torch, kv=kv)


def attn_layers(n: int, start: int = 0) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(start, start + n)]


def mamba_layers(n: int, start: int = 0) -> list[str]:
    return [f"model.layers.{i}.mamba" for i in range(start, start + n)]


def fa_spec(v: SimpleNamespace, block: int = 16, dtype: str = "bfloat16", **kw: Any) -> Any:
    kw.setdefault("num_kv_heads", 2)
    kw.setdefault("head_size", 64)
    return v.kv.FullAttentionSpec(block_size=block, dtype=getattr(v.torch, dtype), **kw)


def mamba_spec(v: SimpleNamespace, block: int = 128, padded: int | None = 65536,
               shapes: tuple = FALCON_SHAPES, dtypes: tuple = ("bfloat16", "float32"),
               **kw: Any) -> Any:
    kw.setdefault("mamba_cache_mode", "align")
    return v.kv.MambaSpec(block_size=block, shapes=shapes,
                          dtypes=tuple(getattr(v.torch, d) for d in dtypes),
                          page_size_padded=padded, **kw)


def translate(v: SimpleNamespace, index: int, spec: Any, layers: list[str]) -> GroupSpec:
    return _group_from_vllm(index, v.kv.KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec))


def hybrid_groups(v: SimpleNamespace, attn_block: int = 16, mamba_block: int = 128,
                  padded: int | None = 65536) -> tuple[GroupSpec, ...]:
    return (
        translate(v, 0, mamba_spec(v, mamba_block, padded), mamba_layers(4)),
        translate(v, 1, fa_spec(v, attn_block), attn_layers(2, 4)),
    )


# ---- translation -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("block", [16, 128])
def test_full_attention(vllm_kv: SimpleNamespace, dtype: str, block: int) -> None:
    spec = fa_spec(vllm_kv, block, dtype)
    g = translate(vllm_kv, 3, spec, attn_layers(3))
    assert g.index == 3 and g.kind is GroupKind.FULL_ATTENTION and g.is_attention
    assert g.block_size == block
    assert g.layer_names == tuple(attn_layers(3))
    assert g.dtype == dtype
    assert (g.num_kv_heads, g.head_size, g.head_size_v) == (2, 64, 64)
    assert g.sliding_window is None and g.state_shapes == () and g.state_bytes == 0
    assert g.page_bytes == spec.page_size_bytes == block * 2 * 2 * 64 * DTYPE_SIZES[dtype]
    # the canonical page of one block holds exactly vLLM's bytes for every layer
    assert g.token_bytes() * block == g.page_bytes
    tensors = g.page_tensors(block)
    assert sum(t.nbytes for t in tensors) == 3 * g.page_bytes
    assert tensors[0] == TensorSpec("L0.k", (block, 2, 64), dtype)
    assert tensors[1] == TensorSpec("L0.v", (block, 2, 64), dtype)


def test_head_size_v(vllm_kv: SimpleNamespace) -> None:
    spec = fa_spec(vllm_kv, 16, head_size=64, head_size_v=32, num_kv_heads=4)
    g = translate(vllm_kv, 0, spec, attn_layers(1))
    assert (g.num_kv_heads, g.head_size, g.head_size_v) == (4, 64, 32)
    assert g.page_bytes == spec.page_size_bytes == 16 * 4 * (64 + 32) * 2
    assert g.token_bytes() * 16 == g.page_bytes
    assert [t.shape for t in g.page_tensors(16)] == [(16, 4, 64), (16, 4, 32)]


def test_sliding_window(vllm_kv: SimpleNamespace) -> None:
    spec = vllm_kv.kv.SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=128,
                                        dtype=vllm_kv.torch.bfloat16, sliding_window=4096)
    g = translate(vllm_kv, 2, spec, attn_layers(2))
    assert g.kind is GroupKind.SLIDING_WINDOW and g.is_attention
    assert g.sliding_window == 4096 and g.block_size == 32
    assert g.page_bytes == spec.page_size_bytes == 32 * 1 * 2 * 128 * 2
    assert g.layout_fields()["sliding_window"] == 4096


def test_full_attention_with_window_field_stays_full(vllm_kv: SimpleNamespace) -> None:
    # vLLM uses FullAttentionSpec(sliding_window=...) when it keeps every block of an SWA
    # layer (hybrid allocator off): all chunks are stored, so it is full attention to us.
    g = translate(vllm_kv, 0, fa_spec(vllm_kv, sliding_window=1024), attn_layers(1))
    assert g.kind is GroupKind.FULL_ATTENTION and g.sliding_window is None


def test_falcon_like_mamba(vllm_kv: SimpleNamespace) -> None:
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    spec = mamba_spec(vllm_kv, block=256)
    g = translate(vllm_kv, 0, spec, mamba_layers(4))
    assert g.kind is GroupKind.MAMBA and not g.is_attention
    assert g.block_size == 256
    assert g.state_shapes == FALCON_SHAPES
    assert all(isinstance(s, tuple) for s in g.state_shapes)
    assert g.state_dtypes == ("bfloat16", "float32")
    assert g.dtype == "bfloat16"
    assert g.page_bytes == spec.page_size_bytes == 65536  # vLLM's padded page
    assert g.state_bytes == 3 * 288 * 2 + 4 * 64 * 16 * 4 == 18112  # ours is unpadded
    assert g.mamba_cache_mode == "align"
    assert g.mamba_type == "MAMBA2"
    assert g.conv_layout == get_conv_state_layout()
    assert g.token_bytes() == 0 and g.num_kv_heads == 0
    tensors = g.page_tensors(256)  # state pages do not depend on the token count
    assert tensors == g.page_tensors(1)
    # the conv state by component (x, B, C), the SSM state by head
    assert [(t.name, t.shape) for t in tensors[:5]] == [
        ("L0.s0.x", (3, 256)), ("L0.s0.B", (3, 16)), ("L0.s0.C", (3, 16)),
        ("L0.s1.heads", (4, 64, 16)), ("L1.s0.x", (3, 256))]
    assert sum(t.nbytes for t in tensors) == 4 * 18112
    assert g.layout_fields()["state_shapes"] == [[3, 288], [4, 64, 16]]
    assert [[c.units for c in s.components] for s in g.state_splits] == [[4, 1, 1], [4]]


def test_gdn_mamba(vllm_kv: SimpleNamespace) -> None:
    enum = type(vllm_kv.kv.MambaSpec.__dataclass_fields__["mamba_type"].default)
    spec = mamba_spec(vllm_kv, block=640, padded=None, shapes=((3, 768), (2, 128, 128)),
                      dtypes=("bfloat16", "bfloat16"), mamba_type=enum.GDN_ATTN)
    g = translate(vllm_kv, 1, spec, ["model.layers.0.linear_attn"])
    assert g.kind is GroupKind.MAMBA and g.mamba_type == "GDN_ATTN"
    assert g.page_bytes == g.state_bytes == (3 * 768 + 2 * 128 * 128) * 2
    assert g.layout_fields()["mamba_type"] == "GDN_ATTN"


def test_mamba_none_mode_kept(vllm_kv: SimpleNamespace) -> None:
    g = translate(vllm_kv, 0, mamba_spec(vllm_kv, mamba_cache_mode="none"), mamba_layers(1))
    assert g.mamba_cache_mode == "none"


def _unsupported_specs(v: SimpleNamespace) -> dict[str, Any]:
    kv, bf16 = v.kv, v.torch.bfloat16
    common = {"block_size": 16, "num_kv_heads": 1, "head_size": 64, "dtype": bf16}
    return {
        "CrossAttentionSpec": kv.CrossAttentionSpec(**common),
        "ChunkedLocalAttentionSpec": kv.ChunkedLocalAttentionSpec(**common,
                                                                  attention_chunk_size=64),
        # subclasses of FullAttentionSpec with other page layouts or block lifetimes
        "MLAAttentionSpec": kv.MLAAttentionSpec(**{**common, "head_size": 576}),
        "SinkFullAttentionSpec": kv.SinkFullAttentionSpec(**common),
    }


def test_unsupported_spec_types(vllm_kv: SimpleNamespace) -> None:
    for name, spec in _unsupported_specs(vllm_kv).items():
        assert type(spec).__name__ == name
        with pytest.raises(ValueError, match=name) as info:
            translate(vllm_kv, 5, spec, attn_layers(1))
        assert "group 5" in str(info.value)


def test_unsupported_dtype(vllm_kv: SimpleNamespace) -> None:
    spec = fa_spec(vllm_kv, dtype="complex64")
    with pytest.raises(ValueError, match="complex64"):
        translate(vllm_kv, 0, spec, attn_layers(1))


# ---- fingerprint -----------------------------------------------------------------------------
def test_fingerprint_is_a_stable_digest() -> None:
    a = compute_fingerprint({"b": [1, 2], "a": {"y": None, "x": "s"}})
    b = compute_fingerprint({"a": {"x": "s", "y": None}, "b": [1, 2]})  # key order is irrelevant
    assert a == b and len(a) == 32 and int(a, 16) >= 0
    assert compute_fingerprint({"b": [2, 1], "a": {"x": "s", "y": None}}) != a
    spec = make_model_spec((), MODEL)
    assert isinstance(spec, ModelSpec) and spec.fingerprint_bytes == bytes.fromhex(spec.fingerprint)
    assert spec.fingerprint_fields["format_version"] == FORMAT_VERSION


def test_translated_fingerprint_is_stable(vllm_kv: SimpleNamespace) -> None:
    first = make_model_spec(hybrid_groups(vllm_kv), MODEL)
    again = make_model_spec(hybrid_groups(vllm_kv), dict(MODEL))
    assert first.fingerprint == again.fingerprint
    assert first == again


_SUBPROCESS_FP = """
import json, sys
from hybrid_offload.core.spec import GroupSpec, make_model_spec
args = json.loads(sys.argv[1])
groups = tuple(GroupSpec.from_dict(g) for g in args["groups"])
print(make_model_spec(groups, args["model"], max_shards=4).fingerprint)
"""


def test_fingerprint_same_in_another_process(vllm_kv: SimpleNamespace) -> None:
    groups = hybrid_groups(vllm_kv)
    here = make_model_spec(groups, MODEL, max_shards=4).fingerprint
    args = json.dumps({"groups": [dataclasses.asdict(g) for g in groups], "model": MODEL})
    for seed in ("0", "4242"):
        out = subprocess.run([sys.executable, "-c", _SUBPROCESS_FP, args],
                             env={**os.environ, "PYTHONHASHSEED": seed},
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == here


def test_fingerprint_ignores_block_size_and_padding(vllm_kv: SimpleNamespace) -> None:
    base = make_model_spec(hybrid_groups(vllm_kv), MODEL).fingerprint
    same = [
        hybrid_groups(vllm_kv, attn_block=32),
        hybrid_groups(vllm_kv, attn_block=128, mamba_block=256),
        hybrid_groups(vllm_kv, padded=None),
        hybrid_groups(vllm_kv, padded=1 << 20),
    ]
    for groups in same:
        assert make_model_spec(groups, MODEL).fingerprint == base
    # nor engine sizes and the TP rank (scheduler and workers share one namespace)
    assert make_model_spec(hybrid_groups(vllm_kv), MODEL, max_model_len=4096, num_blocks=7,
                           tp_rank=0).fingerprint == base


def test_fingerprint_changes_with_what_pages_depend_on(vllm_kv: SimpleNamespace,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    v = vllm_kv
    mamba, attn = hybrid_groups(v)
    base = make_model_spec((mamba, attn), MODEL).fingerprint

    def fp(groups: tuple[GroupSpec, ...] = (mamba, attn), model: dict = MODEL, **kw: int) -> str:
        return make_model_spec(groups, model, **kw).fingerprint

    variants = {
        "model name": fp(model={**MODEL, "name": "other/model"}),
        "revision": fp(model={**MODEL, "revision": "v2"}),
        "hf config": fp(model={**MODEL, "hf_config": "4567"}),
        "model dtype": fp(model={**MODEL, "dtype": "float16"}),
        "kv cache dtype": fp(model={**MODEL, "kv_cache_dtype": "fp8"}),
        "attention dtype": fp((mamba, translate(v, 1, fa_spec(v, dtype="float16"),
                                                attn_layers(2, 4)))),
        "kv heads": fp((mamba, translate(v, 1, fa_spec(v, num_kv_heads=4), attn_layers(2, 4)))),
        "head size": fp((mamba, translate(v, 1, fa_spec(v, head_size=128), attn_layers(2, 4)))),
        "sliding window": fp((mamba, translate(
            v, 1, v.kv.SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64,
                                         dtype=v.torch.bfloat16, sliding_window=512),
            attn_layers(2, 4)))),
        "state dtype": fp((translate(v, 0, mamba_spec(v, dtypes=("bfloat16", "bfloat16")),
                                     mamba_layers(4)), attn)),
        "state shape": fp((translate(v, 0, mamba_spec(v, shapes=((3, 288), (4, 64, 32))),
                                     mamba_layers(4)), attn)),
        "group order": fp((attn, mamba)),
        "extra group": fp((mamba, attn, attn)),
        "fewer groups": fp((attn,)),
        "shard count": fp(max_shards=2),
    }
    monkeypatch.setattr(core_spec, "FORMAT_VERSION", FORMAT_VERSION + 1)
    variants["format version"] = fp()
    monkeypatch.undo()
    assert fp() == base
    # layer names are not in it (a pipeline stage knows its own only): page keys and headers
    # carry them (tests/unit/test_layer_parts.py)
    assert fp((mamba, translate(v, 1, fa_spec(v), attn_layers(2, 5)))) == base
    for what, digest in variants.items():
        assert digest != base, what
    assert len(set(variants.values())) == len(variants)


# ---- model_spec_from_vllm with a stand-in VllmConfig -----------------------------------------
class _HFConfig:
    def __init__(self, **fields: Any) -> None:
        self._fields = fields
        self.architectures = fields.get("architectures")
        for key in ("mamba_n_groups",):
            if key in fields:
                setattr(self, key, fields[key])

    def to_dict(self) -> dict[str, Any]:
        return dict(self._fields)


def _vllm_config(v: SimpleNamespace, hf: dict[str, Any], tp: int = 1, **model: Any) -> SimpleNamespace:
    load_format = model.pop("load_format", "auto")
    fields = {"model": "/models/tiny", "revision": None, "code_revision": None,
              "quantization": None, "hf_overrides": {}, "model_impl": "auto", "seed": 0, **model}
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=_HFConfig(**hf), dtype=v.torch.bfloat16,
                                     max_model_len=8192, get_total_num_kv_heads=lambda: 2,
                                     get_total_num_hidden_layers=lambda: 4, **fields),
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_dtype_skip_layers=[]),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        load_config=SimpleNamespace(load_format=load_format),
    )


def test_model_spec_from_vllm(vllm_kv: SimpleNamespace) -> None:
    v = vllm_kv
    groups = [v.kv.KVCacheGroupSpec(layer_names=mamba_layers(2), kv_cache_spec=mamba_spec(v)),
              v.kv.KVCacheGroupSpec(layer_names=attn_layers(1, 2), kv_cache_spec=fa_spec(v))]
    kv_config = v.kv.KVCacheConfig(num_blocks=123, kv_cache_tensors=[], kv_cache_groups=groups)
    hf = {"architectures": ["FalconH1ForCausalLM"], "hidden_size": 256,
          "_name_or_path": "/a/b", "transformers_version": "4.57.0"}
    spec = model_spec_from_vllm(_vllm_config(v, hf), kv_config)
    assert [g.kind for g in spec.groups] == [GroupKind.MAMBA, GroupKind.FULL_ATTENTION]
    assert [g.index for g in spec.groups] == [0, 1]
    assert (spec.max_model_len, spec.num_blocks, spec.tp_rank, spec.tp_size) == (8192, 123, 0, 1)
    model = spec.fingerprint_fields["model"]
    assert model["architectures"] == ["FalconH1ForCausalLM"]
    assert model["dtype"] == "bfloat16" and model["kv_cache_dtype"] == "auto"
    # where the model lives and which transformers wrote it do not matter; its config does
    moved = {**hf, "_name_or_path": "/elsewhere", "transformers_version": "5.0.0"}
    assert model_spec_from_vllm(_vllm_config(v, moved), kv_config).fingerprint == spec.fingerprint
    changed = {**hf, "hidden_size": 512}
    assert model_spec_from_vllm(_vllm_config(v, changed), kv_config).fingerprint != spec.fingerprint


def test_model_spec_from_vllm_tensor_parallel(vllm_kv: SimpleNamespace) -> None:
    """A TP=2 rank's halves of the model translate to the TP=1 layout: same fingerprint, same
    page tensors per shard; the scheduler process (no TP group) is rank 0."""
    v = vllm_kv

    def kv_config(heads: int, shapes: tuple) -> Any:
        groups = [v.kv.KVCacheGroupSpec(layer_names=mamba_layers(2),
                                        kv_cache_spec=mamba_spec(v, shapes=shapes)),
                  v.kv.KVCacheGroupSpec(layer_names=attn_layers(1, 2),
                                        kv_cache_spec=fa_spec(v, num_kv_heads=heads))]
        return v.kv.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)

    hf = {"architectures": ["FalconH1ForCausalLM"], "mamba_n_groups": 1}
    tp1 = model_spec_from_vllm(_vllm_config(v, hf, tp=1), kv_config(2, FALCON_SHAPES), 8)
    # vLLM at TP=2: half the heads, the single Mamba group replicated on both ranks
    tp2 = model_spec_from_vllm(_vllm_config(v, hf, tp=2), kv_config(1, ((3, 160), (2, 64, 16))), 8)
    assert (tp2.tp_rank, tp2.tp_size) == (0, 2)
    assert tp2.fingerprint == tp1.fingerprint
    assert "tp_size" not in tp2.fingerprint_fields
    assert [g.shards for g in tp2.groups] == [4, 2]
    for g1, g2 in zip(tp1.groups, tp2.groups, strict=True):
        assert [g1.page_tensors(16, p) for p in range(g1.shards)] == [
            g2.page_tensors(16, p) for p in range(g2.shards)]
    with pytest.raises(ValueError, match="rank shapes"):  # 2 of 2 KV heads is not a TP=2 split
        model_spec_from_vllm(_vllm_config(v, hf, tp=2), kv_config(2, ((3, 160), (2, 64, 16))), 8)
    with pytest.raises(ValueError, match="group count"):  # 1 group per rank: 1 or 2 in all?
        model_spec_from_vllm(_vllm_config(v, {"architectures": ["X"]}, tp=2),
                             kv_config(1, ((3, 160), (2, 64, 16))), 8)


def test_ds_conv_layout_translates_to_the_pages_of_sd(vllm_kv: SimpleNamespace,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own shape code at VLLM_SSM_CONV_STATE_LAYOUT=DS keeps the conv state (dim,
    state_len); the group holds it as SD, as pages do, so DS and SD engines share pages."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator, get_conv_state_layout
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    gdn_type = MambaAttentionBackendEnum.GDN_ATTN

    def shapes_and_group(layout: str) -> tuple[tuple, GroupSpec, GroupSpec]:
        monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", layout)
        get_conv_state_layout.cache_clear()  # vLLM caches the layout per process
        if get_conv_state_layout() != layout:
            pytest.skip("this vLLM does not read VLLM_SSM_CONV_STATE_LAYOUT at call time")
        mamba2 = MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=1, intermediate_size=256, n_groups=1, num_heads=4, head_dim=64,
            state_size=16, conv_kernel=4)  # fmt: skip
        gdn = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 2, 4, 32, 32, 4)
        return (
            mamba2,
            translate(vllm_kv, 0, mamba_spec(vllm_kv, shapes=mamba2), mamba_layers(1)),
            translate(vllm_kv, 1, mamba_spec(vllm_kv, shapes=gdn, mamba_type=gdn_type), mamba_layers(1, 1)),
        )

    try:
        sd_shapes, *sd = shapes_and_group("SD")
        ds_shapes, *ds = shapes_and_group("DS")
        translate(vllm_kv, 2, fa_spec(vllm_kv), attn_layers(1))  # attention does not care
    finally:
        monkeypatch.undo()
        get_conv_state_layout.cache_clear()
    assert get_conv_state_layout() == "SD"
    assert ds_shapes[0] == sd_shapes[0][::-1] == (288, 3)  # vLLM's DS block: (dim, state_len)
    for sd_group, ds_group in zip(sd, ds, strict=True):
        assert (sd_group.conv_layout, ds_group.conv_layout) == ("SD", "DS")
        assert ds_group.state_shapes == sd_group.state_shapes
        assert ds_group.layout_fields() == sd_group.layout_fields()
        assert [ds_group.page_tensors(16, p) for p in range(ds_group.shards)] == [
            sd_group.page_tensors(16, p) for p in range(sd_group.shards)]


def test_hf_config_digest_ignores_what_vllm_patches_at_runtime(vllm_kv: SimpleNamespace,
                                                               tmp_path: Path) -> None:
    """vLLM adds fields (e.g. partial_rotary_factor) to the live HF config while it builds the
    model; the scheduler process at TP > 1 never builds it. Both must agree on the fingerprint:
    the digest comes from config.json where the file is at hand, else without those keys."""
    v = vllm_kv
    groups = [v.kv.KVCacheGroupSpec(layer_names=attn_layers(1), kv_cache_spec=fa_spec(v))]
    kv_config = v.kv.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    hf = {"architectures": ["FalconH1ForCausalLM"], "hidden_size": 256}
    patched = {**hf, "partial_rotary_factor": 1.0, "rope_theta": 1e4}
    pristine = model_spec_from_vllm(_vllm_config(v, hf), kv_config).fingerprint
    assert model_spec_from_vllm(_vllm_config(v, patched), kv_config).fingerprint == pristine

    (tmp_path / "config.json").write_text(json.dumps(hf))

    def local(fields: dict[str, Any]) -> str:
        config = _vllm_config(v, fields)
        config.model_config.model = str(tmp_path)
        return model_spec_from_vllm(config, kv_config).fingerprint

    assert local(hf) == local(patched) == local({**hf, "hidden_size": 512})  # the file decides
    (tmp_path / "config.json").write_text(json.dumps({**hf, "hidden_size": 512}))
    assert local(hf) != pristine


HF_TINY = {"architectures": ["FalconH1ForCausalLM"], "hidden_size": 256}


def _fingerprints(v: SimpleNamespace, model_dir: Path, hf: dict[str, Any], **defaults: Any) -> Any:
    """``fp(model_version=None, **model_config_fields)``: the fingerprint of a one-group
    engine on the model in ``model_dir`` (its config.json written from ``hf``)."""
    groups = [v.kv.KVCacheGroupSpec(layer_names=attn_layers(1), kv_cache_spec=fa_spec(v))]
    kv_config = v.kv.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    (model_dir / "config.json").write_text(json.dumps(hf))

    def fp(model_version: str | None = None, **model: Any) -> str:
        config = _vllm_config(v, hf, model=str(model_dir), **{**defaults, **model})
        return model_spec_from_vllm(config, kv_config, model_version=model_version).fingerprint

    return fp


def test_fingerprint_covers_what_changes_kv(vllm_kv: SimpleNamespace, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights (files in the model directory), code revision, quantization, HF overrides and an
    operator's model_version each change the fingerprint (issue 14 H3, M6)."""
    # each fingerprint as an engine started after the files were written takes it (issue 45 N3)
    monkeypatch.setattr(model_identity, "process_start_ns", lambda: 4_102_444_800 * 10**9)
    fp = _fingerprints(vllm_kv, tmp_path, HF_TINY)
    weights = tmp_path / "model.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    weights.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))

    base = fp()
    assert fp() == base
    others = {
        "code_revision": fp(code_revision="abc"),
        "quantization": fp(quantization="fp8"),
        "hf_overrides": fp(hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        "model_version": fp("v2"),
    }
    assert len(set(others.values()) | {base}) == len(others) + 1, others
    # the same bytes' shape, new values written in place: the file's mtime changes
    stat = weights.stat()
    weights.write_bytes(len(header).to_bytes(8, "little") + header + b"\x01" * 16)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert fp() != base
    # an operator-managed version names the weights alone: the files no longer matter
    assert fp("v2") == others["model_version"]


def test_fingerprint_covers_config_source_weights_uri_and_quantization_config(
    vllm_kv: SimpleNamespace, tmp_path: Path
) -> None:
    """The config actually used (hf_config_path), the weights' origin (model_weights), online
    quantization specs and model class overrides each change the fingerprint; a function in
    hf_overrides cannot be named, so it needs model_version (review of issue 14)."""
    fp = _fingerprints(vllm_kv, tmp_path, HF_TINY, load_format="dummy")
    other = tmp_path / "other-config"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**HF_TINY, "rope_theta": 1e6}))

    base = fp()
    others = [
        fp(hf_config_path=str(other)),
        fp(model_weights="s3://bucket/model-v2"),
        fp(quantization_config={"linear": "fp8_per_tensor", "ignore": ["lm_head"]}),
        fp(model_class_overrides={"FalconH1ForCausalLM": "my.module:Model"}),
    ]
    assert len({base, *others}) == len(others) + 1

    def override(config: Any) -> Any:
        return config
    with pytest.raises(UnidentifiableModelError, match="model_version"):
        fp(hf_overrides=override)
    assert fp("v1", hf_overrides=override) != fp("v1")
    with pytest.raises(UnidentifiableModelError, match="identity"):
        fp(quantization_config={"linear": object()})  # a repr with an address



@pytest.mark.parametrize(
    ("mamba_type", "rank_shapes", "t", "want"),
    [
        # LFM2's short conv: (state_len, channels / t), channels split in one run per rank
        ("SHORT_CONV", ((2, 128),), 2, [(1, [("channels", 256, 1)])]),
        # Jamba's Mamba1: conv (state_len, inner / t), SSM (inner / t, state)
        ("MAMBA1", ((3, 64), (64, 16)), 4, [(1, [("channels", 256, 1)]), (0, [("channels", 256, 1)])]),
        # MiniMax / Bailing linear attention: (heads / t, dim, dim)
        ("LINEAR", ((4, 32, 32),), 2, [(0, [("heads", 8, 1)])]),
    ],
)
def test_contiguous_state_types_split_across_tp(
    mamba_type: str, rank_shapes: tuple[tuple[int, ...], ...], t: int, want: list[Any]
) -> None:
    """Issue 44: Mamba1, short-conv and linear-attention states were refused at TP > 1 ("no
    known tensor-parallel split"); vLLM shards each of their tensors in one contiguous run per
    rank (column-parallel outputs), which is what these splits say."""
    from hybrid_offload.engine.translate import ModelShape, mamba_splits

    splits = mamba_splits(mamba_type, rank_shapes, ModelShape(tp_size=t))
    got = [(s.axis, [(c.name, c.units, c.unit_size) for c in s.components]) for s in splits]
    assert got == want
    for split, shape in zip(splits, rank_shapes, strict=True):  # a rank holds exactly its shape
        assert all(split.extent(t, r) == shape[split.axis] for r in range(t))
