"""Translation of vLLM's engine configuration into frozen, vLLM-free dataclasses.

This is the only module that reads vLLM config types (``VllmConfig``, ``KVCacheConfig`` and
the ``KVCacheSpec`` family). Everything else in hybrid-offload works on :class:`ModelSpec`
and :class:`GroupSpec`, which are plain data and can be built by hand in tests.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from enum import StrEnum
from math import prod
from typing import TYPE_CHECKING, Any

import xxhash

from hybrid_offload import FORMAT_VERSION

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

# HF config keys that name where a model lives, not what it is.
_VOLATILE_HF_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})


class GroupKind(StrEnum):
    """How a KV cache group's pages relate to a token prefix."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor in a page payload: C-order ``shape`` of ``dtype`` (a torch dtype name)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class GroupSpec:
    """One vLLM KV cache group, as far as offloading needs to know it.

    Attention groups (full or sliding window) store per-token K and V of ``num_kv_heads`` heads;
    Mamba/GDN groups store per-layer recurrent state tensors (``state_shapes``), whose sizes do
    not depend on the number of tokens.
    """

    index: int
    kind: GroupKind
    block_size: int
    layer_names: tuple[str, ...]
    page_bytes: int
    dtype: str = "bfloat16"
    num_kv_heads: int = 0
    head_size: int = 0
    head_size_v: int = 0
    sliding_window: int | None = None
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[str, ...] = ()
    mamba_cache_mode: str | None = None
    mamba_type: str | None = None
    conv_layout: str | None = None

    @property
    def is_attention(self) -> bool:
        return self.kind is not GroupKind.MAMBA

    @property
    def state_bytes(self) -> int:
        """Unpadded bytes of one layer's Mamba state (0 for attention groups)."""
        return sum(
            prod(s) * DTYPE_SIZES[d] for s, d in zip(self.state_shapes, self.state_dtypes, strict=True)
        )

    def token_bytes(self) -> int:
        """Bytes of K plus V of one token in one layer (0 for Mamba groups)."""
        if not self.is_attention:
            return 0
        return self.num_kv_heads * (self.head_size + self.head_size_v) * DTYPE_SIZES[self.dtype]

    def page_tensors(self, num_tokens: int) -> tuple[TensorSpec, ...]:
        """The payload tensors of one canonical page of this group, in payload order.

        Attention: per layer K ``[tokens][heads][head_size]`` then V. Mamba: per layer each state
        tensor in vLLM's order, without the page padding vLLM adds.
        """
        tensors: list[TensorSpec] = []
        for layer in range(len(self.layer_names)):
            if self.is_attention:
                tensors.append(
                    TensorSpec(f"L{layer}.k", (num_tokens, self.num_kv_heads, self.head_size), self.dtype)
                )
                tensors.append(
                    TensorSpec(f"L{layer}.v", (num_tokens, self.num_kv_heads, self.head_size_v), self.dtype)
                )
            else:
                for i, (shape, dtype) in enumerate(zip(self.state_shapes, self.state_dtypes, strict=True)):
                    tensors.append(TensorSpec(f"L{layer}.s{i}", shape, dtype))
        return tuple(tensors)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroupSpec:
        """Inverse of ``dataclasses.asdict`` after a JSON round trip (lists back to tuples)."""
        return cls(
            **{
                **data,
                "kind": GroupKind(data["kind"]),
                "layer_names": tuple(data["layer_names"]),
                "state_shapes": tuple(tuple(s) for s in data.get("state_shapes", ())),
                "state_dtypes": tuple(data.get("state_dtypes", ())),
            }
        )

    def layout_fields(self) -> dict[str, Any]:
        """What must match for two engines to exchange this group's pages (no block size)."""
        return {
            "kind": self.kind.value,
            "layers": list(self.layer_names),
            "dtype": self.dtype,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "head_size_v": self.head_size_v,
            "sliding_window": self.sliding_window,
            "state_shapes": [list(s) for s in self.state_shapes],
            "state_dtypes": list(self.state_dtypes),
            "mamba_type": self.mamba_type,
            "conv_layout": "SD" if self.kind is GroupKind.MAMBA else None,
        }


@dataclass(frozen=True)
class ModelSpec:
    """The engine's KV groups plus the fingerprint that scopes every page key."""

    groups: tuple[GroupSpec, ...]
    fingerprint: str
    fingerprint_fields: dict[str, Any] = field(compare=False, hash=False, default_factory=dict)
    max_model_len: int = 0
    num_blocks: int = 0
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def fingerprint_bytes(self) -> bytes:
        return bytes.fromhex(self.fingerprint)


def compute_fingerprint(fields: dict[str, Any]) -> str:
    """Stable 128-bit hex digest of canonical JSON (sorted keys; no Python ``hash()``)."""
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str).encode()
    return xxhash.xxh3_128_hexdigest(blob)


def make_model_spec(
    groups: tuple[GroupSpec, ...],
    model_fields: dict[str, Any],
    *,
    max_model_len: int = 0,
    num_blocks: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> ModelSpec:
    """Build a ModelSpec whose fingerprint covers the model, the group layouts, our format
    version and the tensor-parallel size.

    The TP rank is not part of the fingerprint, so that the scheduler (which has no rank) and
    every worker rank share one key namespace; the planner mixes the rank into each page key
    and the page header records it.
    """
    fields = {
        "model": model_fields,
        "groups": [g.layout_fields() for g in groups],
        "format_version": FORMAT_VERSION,
        "tp_size": tp_size,
    }
    return ModelSpec(
        groups=groups,
        fingerprint=compute_fingerprint(fields),
        fingerprint_fields=fields,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"unsupported KV cache dtype {dtype!r}")
    return name


def _group_from_vllm(index: int, group: Any) -> GroupSpec:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    spec = group.kv_cache_spec
    names = tuple(group.layer_names)
    if isinstance(spec, MambaSpec):
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        if get_conv_state_layout() != "SD":
            raise ValueError(
                "hybrid-offload stores Mamba conv states in the SD layout; "
                "VLLM_SSM_CONV_STATE_LAYOUT=DS is not supported"
            )
        return GroupSpec(
            index=index,
            kind=GroupKind.MAMBA,
            block_size=spec.block_size,
            layer_names=names,
            page_bytes=spec.page_size_bytes,
            dtype=_dtype_name(spec.dtypes[0]),
            state_shapes=tuple(tuple(s) for s in spec.shapes),
            state_dtypes=tuple(_dtype_name(d) for d in spec.dtypes),
            mamba_cache_mode=spec.mamba_cache_mode,
            mamba_type=getattr(spec.mamba_type, "name", str(spec.mamba_type)),
            conv_layout="SD",
        )
    # Exact types: vLLM's subclasses (MLA, sink, R-SWA, sliding-window MLA, ...) store other
    # page layouts or drop blocks, so they must not pass as plain attention.
    if type(spec) in (SlidingWindowSpec, FullAttentionSpec):
        window = getattr(spec, "sliding_window", None)
        is_window = type(spec) is SlidingWindowSpec
        kind = GroupKind.SLIDING_WINDOW if is_window else GroupKind.FULL_ATTENTION
        return GroupSpec(
            index=index,
            kind=kind,
            block_size=spec.block_size,
            layer_names=names,
            page_bytes=spec.page_size_bytes,
            dtype=_dtype_name(spec.dtype),
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            head_size_v=spec.head_size_v,
            sliding_window=window if kind is GroupKind.SLIDING_WINDOW else None,
        )
    raise ValueError(
        f"KV cache group {index} has spec {type(spec).__name__}, which hybrid-offload does not "
        "support (supported: full attention, sliding window, Mamba/GDN)"
    )


def _model_fields(vllm_config: VllmConfig) -> dict[str, Any]:
    model_config = vllm_config.model_config
    hf = model_config.hf_config.to_dict()
    hf_clean = {k: v for k, v in hf.items() if k not in _VOLATILE_HF_KEYS}
    return {
        "name": str(model_config.model),
        "revision": model_config.revision,
        "architectures": list(getattr(model_config.hf_config, "architectures", None) or []),
        "hf_config": compute_fingerprint(hf_clean),
        "dtype": _dtype_name(model_config.dtype),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
    }


def model_spec_from_vllm(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> ModelSpec:
    """Translate vLLM's configs into a ModelSpec (call once per connector)."""
    groups = tuple(_group_from_vllm(i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups))
    parallel = vllm_config.parallel_config
    tp_size = parallel.tensor_parallel_size
    tp_rank = 0
    if tp_size > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        try:
            tp_rank = get_tensor_model_parallel_rank()
        except AssertionError:  # scheduler process: no TP group, pages keyed per rank anyway
            tp_rank = 0
    return make_model_spec(
        groups,
        _model_fields(vllm_config),
        max_model_len=vllm_config.model_config.max_model_len,
        num_blocks=kv_cache_config.num_blocks,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
