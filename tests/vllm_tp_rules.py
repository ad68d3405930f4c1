"""vLLM's own tensor-parallel sharding, applied to KV and state tensors (importable as
``vllm_tp_rules``).

Which KV heads, conv channels and SSM heads a TP rank holds is decided here by running vLLM's
weight loaders on index tensors: ``QKVParallelLinear.weight_loader`` (KV heads, with
replication when there are fewer KV heads than ranks), ``mamba_v2_sharded_weight_loader`` with
the shard settings ``MambaMixer2`` / the Qwen GDN layer give their conv1d (x, B, C or q, k, v;
a single Mamba group replicated) and ``sharded_weight_loader(0)`` (SSM heads). The rank
shapes come from ``MambaStateShapeCalculator``. Nothing here uses hybrid-offload's own
split logic, so tests can check it against vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TypeVar
from unittest import mock

import torch

T = TypeVar("T")


def _run_patched(t: int, r: int, fn: Callable[[], T]) -> T:
    """Run ``fn`` with vLLM's TP world size and rank queries answering ``t`` and ``r``."""
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.model_loader.weight_utils as weight_utils
    import vllm.model_executor.parameter as parameter

    with ExitStack() as stack:
        for module in (linear, parameter, weight_utils):
            for name, value in (("get_tensor_model_parallel_world_size", t),
                                ("get_tensor_model_parallel_rank", r)):
                if hasattr(module, name):
                    stack.enter_context(mock.patch.object(module, name, return_value=value))
        return fn()


def kv_heads(total_heads: int, total_kv: int, head_size: int, t: int, r: int) -> list[int]:
    """KV heads rank ``r`` of ``t`` holds, by ``QKVParallelLinear.weight_loader``."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    def load() -> list[int]:
        layer = QKVParallelLinear(8, head_size, total_heads, total_kv, bias=False,
                                  params_dtype=torch.float32)
        rows = torch.arange(total_kv * head_size, dtype=torch.float32).view(-1, 1).expand(-1, 8)
        layer.weight.data.fill_(-1)
        layer.weight_loader(layer.weight, rows.contiguous(), "k")
        q = layer.num_heads * head_size
        k = layer.weight.data[q : q + layer.num_kv_heads * head_size, 0].long()
        return sorted({int(i) // head_size for i in k})

    return _run_patched(t, r, load)


@dataclass(frozen=True)
class Mamba2Dims:
    heads: int
    head_dim: int
    groups: int
    state: int
    kernel: int


@dataclass(frozen=True)
class GdnDims:
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int


def state_shapes(dims: Mamba2Dims | GdnDims, t: int) -> tuple[tuple[int, ...], ...]:
    """This rank's (conv, ssm) state shapes at TP=t, by ``MambaStateShapeCalculator``."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Calc

    if isinstance(dims, Mamba2Dims):
        return Calc.mamba2_state_shape(t, dims.heads * dims.head_dim, dims.groups, dims.heads,
                                       dims.head_dim, dims.state, dims.kernel)
    return Calc.gated_delta_net_state_shape(t, dims.k_heads, dims.v_heads, dims.k_dim,
                                            dims.v_dim, dims.kernel)


def conv_channels(dims: Mamba2Dims | GdnDims, t: int, r: int) -> torch.Tensor:
    """Full-model conv channels rank ``r`` of ``t`` holds, in its order (vLLM's conv1d loader)."""
    from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Calc

    if isinstance(dims, Mamba2Dims):
        extended = dims.groups + Calc.extra_groups_for_head_shards(dims.groups, t)
        group = (extended * dims.state, (extended - dims.groups) * dims.state, dims.groups == 1)
        specs = [(dims.heads * dims.head_dim, 0, False), group, group]
    else:
        key = (dims.k_heads * dims.k_dim, 0, False)
        specs = [key, key, (dims.v_heads * dims.v_dim, 0, False)]
    full = sum(s[0] - s[1] for s in specs)
    local = state_shapes(dims, t)[0][1]
    param = torch.full((local,), -1, dtype=torch.int64)
    mamba_v2_sharded_weight_loader(specs, t, r)(param, torch.arange(full))
    assert (param >= 0).all(), "vLLM left conv channels of the rank unset"
    return param


def ssm_heads(heads: int, t: int, r: int) -> torch.Tensor:
    """SSM / recurrent heads rank ``r`` of ``t`` holds (``sharded_weight_loader(0)``, as for
    A, D and dt_bias)."""
    from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader

    def load() -> torch.Tensor:
        param = torch.full((heads // t,), -1, dtype=torch.int64)
        sharded_weight_loader(0)(param, torch.arange(heads))
        return param

    return _run_patched(t, r, load)
