"""Translation of vLLM's engine configuration into frozen, vLLM-free dataclasses.

This is the only module that reads vLLM config types (``VllmConfig``, ``KVCacheConfig`` and
the ``KVCacheSpec`` family). Everything else in hybrid-offload works on :class:`ModelSpec`
and :class:`GroupSpec`, which are plain data and can be built by hand in tests.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_offload import FORMAT_VERSION
from hybrid_offload.model_identity import weights_identity
from hybrid_offload.tp_shards import (
    Component,
    ShardLayoutError,
    TensorSplit,
    check_tp_size,
    held_units,
    shard_count,
    shards_written,
)

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
# HF config keys vLLM fills in or normalises on the live config while it builds the model (RoPE)
_RUNTIME_HF_KEYS = frozenset({"partial_rotary_factor", "rope_theta", "rope_parameters", "rope_scaling"})


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
    not depend on the number of tokens. ``num_kv_heads`` and ``state_shapes`` are this TP
    rank's, as vLLM allocates them; ``total_kv_heads`` and ``state_splits`` describe the model
    at TP=1 (see :mod:`hybrid_offload.tp_shards`), and each (chunk, group) page set is
    ``shards`` pages.
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
    total_kv_heads: int = 0
    state_splits: tuple[TensorSplit, ...] = ()
    shards: int = 1

    @property
    def is_attention(self) -> bool:
        return self.kind is not GroupKind.MAMBA

    @property
    def splits(self) -> tuple[TensorSplit, ...]:
        """How each per-layer tensor splits across TP ranks. Attention: the layer's
        ``(2, tokens, heads, head_size)`` K/V by KV head; Mamba/GDN: ``state_splits``, or each
        state tensor as one unsplit unit where the structure is unknown (TP=1 only)."""
        if self.is_attention:
            heads = self.total_kv_heads or self.num_kv_heads
            return (TensorSplit(2, (Component("kv_heads", heads, 1),)),)
        if self.state_splits:
            return self.state_splits
        return tuple(TensorSplit(0, (Component(f"s{i}", 1, s[0]),)) for i, s in enumerate(self.state_shapes))

    @property
    def full_state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``state_shapes`` at TP=1 (() for attention groups)."""
        if self.is_attention:
            return ()
        out = []
        for shape, split in zip(self.state_shapes, self.splits, strict=True):
            full = list(shape)
            full[split.axis] = split.extent(1, 0)
            out.append(tuple(full))
        return tuple(out)

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

    def page_tensors(self, num_tokens: int, shard: int = 0) -> tuple[TensorSpec, ...]:
        """The payload tensors of shard ``shard`` of one (chunk, group) page set, in order.

        Attention: per layer K ``[tokens][heads][head_size]`` then V, of the shard's KV heads.
        Mamba/GDN: per layer, per state tensor in vLLM's order, each component's slice (e.g. the
        conv state's x, B and C), without the page padding vLLM adds. Independent of TP size.
        """
        tensors: list[TensorSpec] = []
        if self.is_attention:
            heads = len(held_units(self.splits[0].components[0].units, self.shards, shard))
            for layer in range(len(self.layer_names)):
                tensors.append(TensorSpec(f"L{layer}.k", (num_tokens, heads, self.head_size), self.dtype))
                tensors.append(TensorSpec(f"L{layer}.v", (num_tokens, heads, self.head_size_v), self.dtype))
            return tuple(tensors)
        parts = self._state_parts(shard)
        for layer in range(len(self.layer_names)):
            tensors.extend(TensorSpec(f"L{layer}.{name}", shape, dtype) for name, shape, dtype in parts)
        return tuple(tensors)

    def _state_parts(self, shard: int) -> list[tuple[str, tuple[int, ...], str]]:
        parts = []
        for i, (shape, dtype, split) in enumerate(
            zip(self.full_state_shapes, self.state_dtypes, self.splits, strict=True)
        ):
            for c_index, c in enumerate(split.components):
                part = list(shape)
                part[split.axis] = split.component_extent(c_index, self.shards, shard)
                name = f"s{i}" if not self.state_splits else f"s{i}.{c.name}"
                parts.append((name, tuple(part), dtype))
        return parts

    def shard_bytes(self, num_tokens: int, shard: int = 0) -> int:
        return sum(t.nbytes for t in self.page_tensors(num_tokens, shard))

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
                "state_splits": tuple(
                    TensorSplit(d["axis"], tuple(Component(**c) for c in d["components"]))
                    for d in data.get("state_splits", ())
                ),
            }
        )

    def layout_fields(self) -> dict[str, Any]:
        """What must match for two engines to exchange this group's pages: the model-wide
        (TP=1) shapes, how they split and into how many shards; no block size, no TP size."""
        return {
            "kind": self.kind.value,
            "layers": list(self.layer_names),
            "dtype": self.dtype,
            "num_kv_heads": self.splits[0].components[0].units if self.is_attention else 0,
            "head_size": self.head_size,
            "head_size_v": self.head_size_v,
            "sliding_window": self.sliding_window,
            "state_shapes": [list(s) for s in self.full_state_shapes],
            "state_dtypes": list(self.state_dtypes),
            "state_splits": [
                [s.axis, [[c.name, c.units, c.unit_size] for c in s.components]]
                for s in self.state_splits
            ],
            "shards": self.shards,
            "mamba_type": self.mamba_type,
            "conv_layout": "SD" if self.kind is GroupKind.MAMBA else None,
        }

    def check_tp(self, tp_size: int) -> None:
        """Raise ShardLayoutError unless this rank's shapes are the TP=1 structure split
        ``tp_size`` ways and every shard has a writer at that TP size."""
        try:
            check_tp_size(self.splits, tp_size)
            if self.is_attention:
                local = [len(held_units(self.splits[0].components[0].units, tp_size, 0))]
                want = [self.num_kv_heads]
            else:
                local = [s.extent(tp_size, 0) for s in self.splits]
                want = [shape[s.axis] for shape, s in zip(self.state_shapes, self.splits, strict=True)]
            if local != want:
                raise ShardLayoutError(f"rank shapes {want} are not the model's {local} at TP={tp_size}")
            shards_written(self.splits, self.shards, tp_size, 0)
        except ShardLayoutError as exc:
            raise ShardLayoutError(f"KV cache group {self.index} ({self.kind.value}): {exc}") from None


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


class UnidentifiableModelError(ValueError):
    """Something that changes the model's KV cannot be named in the fingerprint (a function in
    vLLM's ``hf_overrides``): the operator names the model with ``model_version``."""


def _json_value(value: Any) -> Any:
    """JSON for a config value that JSON does not know, named by its content, never by an
    object identity that differs per process (a repr with an address, a function)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if callable(value) or " at 0x" in (text := str(value)):
        raise UnidentifiableModelError(f"{value!r} is named by its identity, not its content")
    return text


def compute_fingerprint(fields: dict[str, Any]) -> str:
    """Stable 128-bit hex digest (sha256, truncated) of canonical JSON (sorted keys; no
    Python ``hash()``). Raises :class:`UnidentifiableModelError` for a value that has no
    content-based JSON form."""
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=_json_value).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def make_model_spec(
    groups: tuple[GroupSpec, ...],
    model_fields: dict[str, Any],
    *,
    max_model_len: int = 0,
    num_blocks: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
    max_shards: int | None = None,
) -> ModelSpec:
    """Build a ModelSpec whose fingerprint covers the model, the group layouts (at TP=1, with
    their shard counts) and our format version.

    Neither the TP size nor the rank is part of the fingerprint: engines at any TP size share
    pages (each rank writes and reads its shards of a page set). With ``max_shards``, every
    group's shard count is chosen (:func:`~hybrid_offload.tp_shards.shard_count`); raises
    ShardLayoutError (a ValueError) when a group cannot be split ``tp_size`` ways into its shards.
    """
    if max_shards is not None:
        groups = tuple(dataclasses.replace(g, shards=shard_count(g.splits, max_shards)) for g in groups)
    for g in groups:
        g.check_tp(tp_size)
    fields = {
        "model": model_fields,
        "groups": [g.layout_fields() for g in groups],
        "format_version": FORMAT_VERSION,
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


@dataclass(frozen=True)
class ModelShape:
    """What the per-rank KV specs do not say about the whole model: the TP size, the total KV
    heads and the Mamba2 group count (None where the config does not name it)."""

    tp_size: int = 1
    total_kv_heads: int = 0
    mamba_n_groups: int | None = None


#: HF config keys naming the Mamba2 group count, per architecture family
_N_GROUPS_KEYS = ("mamba_n_groups", "n_groups", "mamba_ngroups")


def mamba_splits(
    mamba_type: str, shapes: tuple[tuple[int, ...], ...], shape: ModelShape
) -> tuple[TensorSplit, ...]:
    """The TP=1 structure of a Mamba2 or GDN layer's (conv SD, ssm) state from this rank's
    shapes (vLLM's MambaStateShapeCalculator, inverted); () where it is not known."""
    t = shape.tp_size
    if len(shapes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) != 3:
        return ()
    (_, conv_r), (heads_r, d1, d2) = shapes
    if mamba_type == "MAMBA2":
        head_dim, state = d1, d2
        x_r = heads_r * head_dim
        groups_r, rest = divmod(conv_r - x_r, 2 * state)
        if rest or groups_r < 1:
            return ()
        groups = shape.mamba_n_groups if t > 1 else groups_r  # TP=1: the shapes say it
        if groups is None:
            if t > 1 and groups_r == 1:
                raise ShardLayoutError(
                    "cannot tell the model's Mamba2 group count from its config "
                    f"(none of {_N_GROUPS_KEYS}); needed at tensor_parallel_size={t}"
                )
            groups = groups_r * t
        return (
            TensorSplit(1, (Component("x", heads_r * t, head_dim), Component("B", groups, state),
                            Component("C", groups, state))),
            TensorSplit(0, (Component("heads", heads_r * t, 1),)),
        )
    if mamba_type == "GDN_ATTN":
        v_dim, k_dim = d1, d2
        key_r, rest = divmod(conv_r - heads_r * v_dim, 2)
        if rest or key_r % k_dim:
            return ()
        k_heads = key_r // k_dim * t
        return (
            TensorSplit(1, (Component("q", k_heads, k_dim), Component("k", k_heads, k_dim),
                            Component("v", heads_r * t, v_dim))),
            TensorSplit(0, (Component("heads", heads_r * t, 1),)),
        )
    return ()


def _group_from_vllm(index: int, group: Any, shape: ModelShape | None = None) -> GroupSpec:
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
        shape = shape or ModelShape()
        mamba_type = getattr(spec.mamba_type, "name", str(spec.mamba_type))
        state_shapes = tuple(tuple(s) for s in spec.shapes)
        splits = mamba_splits(mamba_type, state_shapes, shape)
        if not splits and shape.tp_size > 1:
            raise ShardLayoutError(
                f"KV cache group {index}: {mamba_type} state {state_shapes} has no known "
                f"tensor-parallel split; hybrid-offload needs tensor_parallel_size=1 for it"
            )
        return GroupSpec(
            index=index,
            kind=GroupKind.MAMBA,
            block_size=spec.block_size,
            layer_names=names,
            page_bytes=spec.page_size_bytes,
            dtype=_dtype_name(spec.dtypes[0]),
            state_shapes=state_shapes,
            state_dtypes=tuple(_dtype_name(d) for d in spec.dtypes),
            mamba_cache_mode=spec.mamba_cache_mode,
            mamba_type=mamba_type,
            conv_layout="SD",
            state_splits=splits,
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
            # at TP=1 this rank's heads are all of them, whatever the HF config says
            total_kv_heads=(shape.total_kv_heads if shape and shape.tp_size > 1 else 0)
            or spec.num_kv_heads,
        )
    raise ValueError(
        f"KV cache group {index} has spec {type(spec).__name__}, which hybrid-offload does not "
        "support (supported: full attention, sliding window, Mamba/GDN)"
    )


def _config_file(model: str, revision: str | None) -> Path | None:
    """The model's config.json (``model``: vLLM's ``hf_config_path`` or model): in its local
    directory, a config file itself, or in the Hugging Face hub cache."""
    if Path(model).is_file():
        return Path(model)
    local = Path(model) / "config.json"
    if local.is_file():
        return local
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except (ValueError, OSError):  # not a repo id, or no cache
        return None
    return Path(found) if isinstance(found, str) else None


def _hf_config_digest(model_config: Any) -> str:
    """Digest of the model's config as published: its config.json bytes where the file is at
    hand, else the live config without what vLLM rewrites on it while building the model (a
    process that did not build it, the scheduler at TP > 1, would see other values)."""
    source = getattr(model_config, "hf_config_path", None) or model_config.model
    path = _config_file(str(source), model_config.revision)
    if path is not None:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    hf = model_config.hf_config.to_dict()
    skip = _VOLATILE_HF_KEYS | _RUNTIME_HF_KEYS
    return compute_fingerprint({k: v for k, v in hf.items() if k not in skip})


def _hf_overrides(overrides: Any, model_version: str | None) -> Any:
    """``hf_overrides`` as JSON: a dict as is; a function cannot be named by what it does, so
    only with ``model_version`` (which then names it too), by its qualified name."""
    if not callable(overrides):
        return overrides or {}
    if not model_version:
        raise UnidentifiableModelError(
            "vLLM's hf_overrides is a function: hybrid-offload cannot tell which model config it "
            "makes, so pages could be shared with an engine whose function differs. Set "
            "kv_connector_extra_config.model_version to a name for these weights and overrides"
        )
    return f"callable:{getattr(overrides, '__module__', '?')}.{getattr(overrides, '__qualname__', '?')}"


def _weights_fields(model_config: Any, load_format: str, model_version: str | None) -> dict[str, Any]:
    """What names the weights: the operator's ``model_version`` where given, else what
    :mod:`~hybrid_offload.model_identity` finds (a warning where it finds nothing)."""
    if model_version:
        return {"model_version": model_version}
    if load_format == "dummy":
        return {"dummy": True, "seed": model_config.seed}
    identity = weights_identity(str(model_config.model), model_config.revision)
    if "unidentified" in identity:
        _warn_unidentified(str(model_config.model))
    return identity


@functools.cache
def _warn_unidentified(model: str) -> None:
    logger.warning(
        "hybrid-offload cannot identify the weights of %r (no hub snapshot, no local weight "
        "files): pages are keyed by its name and config only, so weights changed under that "
        "name would be served stale pages. Set kv_connector_extra_config.model_version.",
        model,
    )


def _model_fields(vllm_config: VllmConfig, model_version: str | None = None) -> dict[str, Any]:
    """Everything about the model that changes its KV for the same tokens."""
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    return {
        "name": str(model_config.model),
        "model_weights": getattr(model_config, "model_weights", "") or "",
        "hf_config_path": getattr(model_config, "hf_config_path", None),
        "revision": model_config.revision,
        "code_revision": model_config.code_revision,
        "architectures": list(getattr(model_config.hf_config, "architectures", None) or []),
        "hf_config": _hf_config_digest(model_config),
        "hf_overrides": _hf_overrides(model_config.hf_overrides, model_version),
        "model_class_overrides": getattr(model_config, "model_class_overrides", None) or {},
        "weights": _weights_fields(model_config, load_format, model_version),
        "quantization": model_config.quantization,
        "quantization_config": getattr(model_config, "quantization_config", None),
        "model_impl": str(getattr(model_config, "model_impl", "auto")),
        "load_format": load_format,
        "dtype": _dtype_name(model_config.dtype),
        "kv_cache_dtype": str(cache_config.cache_dtype),
        "kv_cache_dtype_skip_layers": sorted(getattr(cache_config, "kv_cache_dtype_skip_layers", None) or []),
    }


def _model_shape(vllm_config: VllmConfig) -> ModelShape:
    model_config = vllm_config.model_config
    hf = model_config.hf_config
    n_groups = next((getattr(hf, k) for k in _N_GROUPS_KEYS if isinstance(getattr(hf, k, None), int)), None)
    total_kv = getattr(model_config, "get_total_num_kv_heads", None)
    return ModelShape(
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        total_kv_heads=total_kv() if callable(total_kv) else 0,
        mamba_n_groups=n_groups,
    )


def model_spec_from_vllm(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    max_shards: int | None = None,
    model_version: str | None = None,
) -> ModelSpec:
    """Translate vLLM's configs into a ModelSpec (call once per connector). ``model_version``
    (the operator's name for the weights) replaces the identity found from the files."""
    shape = _model_shape(vllm_config)
    groups = tuple(
        _group_from_vllm(i, g, shape) for i, g in enumerate(kv_cache_config.kv_cache_groups)
    )
    tp_size = shape.tp_size
    tp_rank = 0
    if tp_size > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        try:
            tp_rank = get_tensor_model_parallel_rank()
        except AssertionError:  # scheduler process: no TP group; it plans for all ranks
            tp_rank = 0
    return make_model_spec(
        groups,
        _model_fields(vllm_config, model_version),
        max_model_len=vllm_config.model_config.max_model_len,
        num_blocks=kv_cache_config.num_blocks,
        tp_rank=tp_rank,
        tp_size=tp_size,
        max_shards=max_shards,
    )
