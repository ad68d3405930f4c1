"""Translation of vLLM's engine configuration into the frozen specs of :mod:`hybrid_offload.core.spec`.

This is the only module that reads vLLM config types (``VllmConfig``, ``KVCacheConfig`` and
the ``KVCacheSpec`` family), once, at connector start-up.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_offload.compat import mamba_rank_dims
from hybrid_offload.core.drafting import Drafting
from hybrid_offload.core.kv_events import KVEventsSpec
from hybrid_offload.core.layer_parts import LayerGrid, LayerPartError, layout_bounds
from hybrid_offload.core.spec import (
    DTYPE_SIZES,
    GroupKind,
    GroupSpec,
    ModelSpec,
    UnidentifiableModelError,
    compute_fingerprint,
    make_model_spec,
)
from hybrid_offload.core.tp_shards import Component, ShardLayoutError, TensorSplit
from hybrid_offload.engine.model_identity import weights_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

# HF config keys that name where a model lives, not what it is.
_VOLATILE_HF_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})
# HF config keys vLLM fills in or normalises on the live config while it builds the model (RoPE)
_RUNTIME_HF_KEYS = frozenset({"partial_rotary_factor", "rope_theta", "rope_parameters", "rope_scaling"})

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
#: Mamba types whose first state is the conv state (vLLM 0.32 ``MambaStateShapeCalculator``)
CONV_FIRST_TYPES = frozenset({"MAMBA1", "MAMBA2", "SHORT_CONV", "GDN_ATTN"})


def mamba_splits(
    mamba_type: str, shapes: tuple[tuple[int, ...], ...], shape: ModelShape
) -> tuple[TensorSplit, ...]:
    """The TP=1 structure of a Mamba/GDN layer's state from this rank's shapes (SD conv state
    first): Mamba2 and GDN from :func:`hybrid_offload.compat.mamba_rank_dims`; Mamba1, short
    conv and linear attention, whose tensors vLLM shards in one contiguous run each (conv and SSM
    channels; heads), from the shapes alone; () where it is not known."""
    t = shape.tp_size
    if mamba_type == "SHORT_CONV" and len(shapes) == 1 and len(shapes[0]) == 2:
        return (TensorSplit(1, (Component("channels", shapes[0][1] * t, 1),)),)
    if mamba_type == "MAMBA1" and len(shapes) == 2 and all(len(x) == 2 for x in shapes):
        conv, ssm = shapes
        return (
            TensorSplit(1, (Component("channels", conv[1] * t, 1),)),
            TensorSplit(0, (Component("channels", ssm[0] * t, 1),)),
        )
    if mamba_type == "LINEAR" and len(shapes) == 1 and len(shapes[0]) == 3:
        return (TensorSplit(0, (Component("heads", shapes[0][0] * t, 1),)),)
    dims = mamba_rank_dims(mamba_type, shapes)
    if dims is None:
        return ()
    heads = TensorSplit(0, (Component("heads", dims.heads * t, 1),))
    if mamba_type == "MAMBA2":
        groups = shape.mamba_n_groups if t > 1 else dims.groups  # TP=1: the shapes say it
        if groups is None:
            if t > 1 and dims.groups == 1:
                raise ShardLayoutError(
                    "cannot tell the model's Mamba2 group count from its config "
                    f"(none of {_N_GROUPS_KEYS}); needed at tensor_parallel_size={t}"
                )
            groups = dims.groups * t
        return (
            TensorSplit(1, (Component("x", dims.heads * t, dims.head_dim),
                            Component("B", groups, dims.state), Component("C", groups, dims.state))),
            heads,
        )
    k_heads = dims.groups * t  # GDN_ATTN: key heads of key dim (state), value heads of value dim
    return (
        TensorSplit(1, (Component("q", k_heads, dims.state), Component("k", k_heads, dims.state),
                        Component("v", dims.heads * t, dims.head_dim))),
        heads,
    )


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

        shape = shape or ModelShape()
        mamba_type = getattr(spec.mamba_type, "name", str(spec.mamba_type))
        state_shapes = tuple(tuple(s) for s in spec.shapes)
        conv_layout = get_conv_state_layout() if mamba_type != "LINEAR" else "SD"  # LINEAR: no conv
        if conv_layout == "DS":
            if mamba_type not in CONV_FIRST_TYPES:
                raise ValueError(
                    f"KV cache group {index}: VLLM_SSM_CONV_STATE_LAYOUT=DS with Mamba type "
                    f"{mamba_type}, whose conv state hybrid-offload cannot find; unset it (SD)"
                )
            # vLLM keeps the conv state (dim, state_len); pages hold it as SD (state_len, dim)
            state_shapes = (state_shapes[0][::-1], *state_shapes[1:])
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
            conv_layout=conv_layout,
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
    :mod:`~hybrid_offload.engine.model_identity` finds (a warning where it finds nothing)."""
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


def _ranks(tp_size: int, pp_size: int) -> tuple[int, int]:
    """This process's (TP rank, PP rank); (0, 0) in the scheduler process, which has no
    parallel groups and plans for all ranks."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    tp_rank = pp_rank = 0
    try:
        if tp_size > 1:
            tp_rank = get_tensor_model_parallel_rank()
        if pp_size > 1:
            pp_rank = get_pp_group().rank_in_group
    except AssertionError:
        return 0, 0
    return tp_rank, pp_rank


#: architectures whose KV layer names do not carry their decoder layer (Zamba2 names its shared
#: attention blocks' layers by hybrid-layer ordinal); vLLM runs none of them pipeline parallel
_UNINDEXED_ARCHS = frozenset({"Zamba2ForCausalLM"})


def layer_grid(vllm_config: VllmConfig, layer_parts: int | None) -> LayerGrid:
    """The layout this engine writes (core/layer_parts.py): its pipeline stages as vLLM places
    them (``VLLM_PP_LAYER_PARTITION`` included) and, with ``layer_parts``, vLLM's default
    partition at that PP size. Raises LayerPartError where the model's layer names do not
    tell their decoder layers and the layout has several parts."""
    from vllm.distributed.utils import get_pp_indices

    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    num_layers = vllm_config.model_config.get_total_num_hidden_layers()
    archs = set(getattr(vllm_config.model_config.hf_config, "architectures", None) or ())
    indexed = not archs & _UNINDEXED_ARCHS
    stages = [get_pp_indices(num_layers, rank, pp_size) for rank in range(pp_size)]
    bounds = layout_bounds(num_layers, stages, layer_parts)
    if len(bounds) == 2:
        return LayerGrid(num_layers, (), indexed)
    if not indexed:
        raise LayerPartError(
            f"layer_parts={layer_parts}: {sorted(archs)[0]} names its KV layers without their decoder "
            "layers, so its page sets cannot be split into layer parts"
        )
    return LayerGrid(num_layers, bounds, indexed)


def _check_stage(grid: LayerGrid, groups: tuple[GroupSpec, ...], pp_rank: int, pp_size: int) -> None:
    """LayerPartError unless every layer of this stage falls in this stage's decoder layers (a
    layer whose decoder layer its name does not tell would be keyed in another stage's part)."""
    from vllm.distributed.utils import get_pp_indices

    start, end = get_pp_indices(grid.num_layers, pp_rank, pp_size)
    for g in groups:
        for (s, e), positions in grid.ranges(g.layer_names).items():
            if not start <= s < e <= end:
                names = [g.layer_names[i] for i in positions]
                raise LayerPartError(
                    f"KV cache group {g.index}: layers {names} fall in decoder layers [{s}, {e}), "
                    f"outside pipeline stage {pp_rank} (decoder layers [{start}, {end}))"
                )


def model_spec_from_vllm(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    max_shards: int | None = None,
    model_version: str | None = None,
    layer_parts: int | None = None,
) -> ModelSpec:
    """Translate vLLM's configs into a ModelSpec (call once per connector). ``model_version``
    (the operator's name for the weights) replaces the identity found from the files;
    ``layer_parts``: see :func:`layer_grid`. Under pipeline parallelism ``kv_cache_config``
    holds this stage's layers (the scheduler's: the first stage's)."""
    shape = _model_shape(vllm_config)
    groups = tuple(
        _group_from_vllm(i, g, shape) for i, g in enumerate(kv_cache_config.kv_cache_groups)
    )
    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    tp_rank, pp_rank = _ranks(shape.tp_size, pp_size)
    grid = layer_grid(vllm_config, layer_parts)
    if pp_size > 1:
        _check_stage(grid, groups, pp_rank, pp_size)
    return make_model_spec(
        groups,
        _model_fields(vllm_config, model_version),
        max_model_len=vllm_config.model_config.max_model_len,
        num_blocks=kv_cache_config.num_blocks,
        tp_rank=tp_rank,
        tp_size=shape.tp_size,
        max_shards=max_shards,
        grid=grid,
        pp_rank=pp_rank,
        pp_size=pp_size,
    )


def drafting_from_vllm(vllm_config: VllmConfig) -> Drafting | None:
    """The engine's speculative decoding (None without a ``speculative_config`` or drafts)."""
    spec = getattr(vllm_config, "speculative_config", None)
    tokens = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    if not tokens:
        return None
    assert spec is not None
    return Drafting(
        method=str(spec.method),
        num_tokens=tokens,
        async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
    )


def kv_events_from_vllm(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, token_ids: bool = True
) -> KVEventsSpec | None:
    """How vLLM publishes KV events in this engine (None when it publishes none): the block
    size its requests' hashes cover (as its engine core resolves it) and how hashes travel;
    ``token_ids``: whether ours carry the blocks' tokens (``kv_events_token_ids``)."""
    events = getattr(vllm_config, "kv_events_config", None)
    if events is None or not events.enable_kv_cache_events or events.publisher == "null":
        return None
    from vllm import envs
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    _, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return KVEventsSpec(hash_block_size, bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), token_ids)
