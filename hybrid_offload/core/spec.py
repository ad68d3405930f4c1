"""The frozen, engine-free description of a model's KV cache groups and its fingerprint.

Everything in hybrid-offload works on :class:`ModelSpec` and :class:`GroupSpec`: plain data,
built from vLLM's config by :mod:`hybrid_offload.engine.translate` or by hand in tests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from math import prod
from typing import Any

from hybrid_offload import FORMAT_VERSION
from hybrid_offload.core.layer_parts import WHOLE_MODEL, LayerGrid
from hybrid_offload.core.tp_shards import (
    Component,
    ShardLayoutError,
    TensorSplit,
    check_tp_size,
    held_units,
    shard_count,
    shards_written,
)

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
    at TP=1 (see :mod:`hybrid_offload.core.tp_shards`), and each (chunk, group) page set is
    ``shards`` pages. ``state_shapes`` hold the conv state as SD ``(state_len, dim)``, as pages
    do; ``conv_layout`` says how the engine keeps it (``DS``: ``(dim, state_len)``, so copies go
    through a transposed view).
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

    def page_tensors(
        self, num_tokens: int, shard: int = 0, layers: int | None = None
    ) -> tuple[TensorSpec, ...]:
        """The payload tensors of shard ``shard`` of one (chunk, group) page set, in order, for
        ``layers`` layers (a layer part's; default all of ``layer_names``).

        Attention: per layer K ``[tokens][heads][head_size]`` then V, of the shard's KV heads.
        Mamba/GDN: per layer, per state tensor in vLLM's order, each component's slice (e.g. the
        conv state's x, B and C), without the page padding vLLM adds. Independent of TP size.
        """
        tensors: list[TensorSpec] = []
        layers = len(self.layer_names) if layers is None else layers
        if self.is_attention:
            heads = len(held_units(self.splits[0].components[0].units, self.shards, shard))
            for layer in range(layers):
                tensors.append(TensorSpec(f"L{layer}.k", (num_tokens, heads, self.head_size), self.dtype))
                tensors.append(TensorSpec(f"L{layer}.v", (num_tokens, heads, self.head_size_v), self.dtype))
            return tuple(tensors)
        parts = self._state_parts(shard)
        for layer in range(layers):
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

    def layout_fields(self, layers: bool = True) -> dict[str, Any]:
        """What must match for two engines to exchange this group's pages: the model-wide
        (TP=1) shapes, how they split and into how many shards, and (``layers``) its layer
        names; no block size, no TP size."""
        return {
            "kind": self.kind.value,
            **({"layers": list(self.layer_names)} if layers else {}),
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
    grid: LayerGrid = WHOLE_MODEL
    pp_rank: int = 0
    pp_size: int = 1

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
    grid: LayerGrid = WHOLE_MODEL,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> ModelSpec:
    """Build a ModelSpec whose fingerprint covers the model, the group layouts (at TP=1, with
    their shard counts) and our format version.

    Neither the TP nor the PP size nor the ranks nor the layer-part ``grid`` (the layout this
    engine writes) are part of the fingerprint: engines at any TP size share pages (each rank
    writes and reads its shards of a page set), and at any PP layout (``groups`` hold this
    stage's layers; each stage writes the parts of its layers and reads any layout's parts
    that hold them). With ``max_shards``, every
    group's shard count is chosen (:func:`~hybrid_offload.core.tp_shards.shard_count`); raises
    ShardLayoutError (a ValueError) when a group cannot be split ``tp_size`` ways into its shards.
    """
    if max_shards is not None:
        groups = tuple(dataclasses.replace(g, shards=shard_count(g.splits, max_shards)) for g in groups)
    for g in groups:
        g.check_tp(tp_size)
    fields = {
        "model": model_fields,
        # no layer names: a pipeline stage knows only its own; they key each part's pages
        # instead (core/layer_parts.py), so engines at any PP layout share a fingerprint
        "groups": [g.layout_fields(layers=False) for g in groups],
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
        grid=grid,
        pp_rank=pp_rank,
        pp_size=pp_size,
    )
