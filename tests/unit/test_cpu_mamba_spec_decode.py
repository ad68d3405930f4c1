"""The CPU Mamba kernels for decode steps with draft tokens (``cpu_mamba_spec_decode``) against
vLLM's own one-token CPU kernels run token by token: same outputs, and every state the next
step may start from (after any number of accepted tokens) is the state after that token."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu  # noqa: E402
from vllm.model_executor.layers.mamba.ops.ssu_dispatch import CPUSSUBackend  # noqa: E402

from hybrid_offload.engine.patches.cpu_mamba_spec_decode import (  # noqa: E402
    conv_update_spec,
    spec_aware_ssu,
)

DIM, WIDTH, DRAFTS = 24, 4, 3
NULL = 0


def test_conv_update_of_drafts_equals_one_token_steps() -> None:
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(DIM, WIDTH, generator=g), torch.randn(DIM, generator=g)
    state = torch.randn(6, DIM, WIDTH - 1 + DRAFTS, generator=g)
    lengths, accepted, lines = [4, 2, 1], [1, 3, 2], [2, 5, 3]
    x = torch.randn(sum(lengths), DIM, generator=g)
    starts = torch.tensor([0, 4, 6, 7], dtype=torch.int32)
    spec_state = state.clone()
    out = conv_update_spec(
        x.clone(), spec_state, weight, bias, True, torch.tensor(lines, dtype=torch.int32)[:, None],
        torch.tensor(accepted, dtype=torch.int32), starts, NULL, torch.empty_like(x),
    )
    for b, (line, acc) in enumerate(zip(lines, accepted, strict=True)):
        window = torch.zeros(2, DIM, WIDTH - 1)  # line 0 is vLLM's null block
        window[1] = state[line, :, acc - 1 : acc - 1 + WIDTH - 1]
        for i, t in enumerate(range(int(starts[b]), int(starts[b + 1]))):
            expected = causal_conv1d_update_cpu(x[t : t + 1].clone(), window, weight, bias, "silu",
                                                torch.tensor([1], dtype=torch.int32))
            torch.testing.assert_close(out[t], expected[0], rtol=1e-5, atol=1e-5)
            # a next step that accepted i + 1 tokens reads the window at column i
            torch.testing.assert_close(spec_state[line, :, i : i + WIDTH - 1], window[1])


def test_ssm_update_of_drafts_equals_one_token_steps() -> None:
    g = torch.Generator().manual_seed(2)
    heads, head_dim, dstate, groups = 4, 8, 16, 2
    tokens, lines = 5, 12
    state = torch.randn(lines, heads, head_dim, dstate, generator=g)
    x = torch.randn(tokens, heads, head_dim, generator=g)
    z = torch.randn(tokens, heads, head_dim, generator=g)
    # as MambaMixer2 calls it: A, dt, dt_bias and D tied over head_dim
    dt = torch.randn(tokens, heads, generator=g)[:, :, None].expand(-1, -1, head_dim)
    A = (-torch.rand(heads, generator=g))[:, None, None].expand(-1, head_dim, dstate)
    dt_bias = torch.randn(heads, generator=g)[:, None].expand(-1, head_dim)
    D = torch.randn(heads, generator=g)[:, None].expand(-1, head_dim)
    B = torch.randn(tokens, groups, dstate, generator=g)
    C = torch.randn(tokens, groups, dstate, generator=g)
    indices = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
    accepted = torch.tensor([2, 1], dtype=torch.int32)
    starts = torch.tensor([0, 3, 5], dtype=torch.int32)
    backend = CPUSSUBackend.__new__(CPUSSUBackend)
    from vllm import _custom_ops as ops

    backend._cpp_kernel = ops.selective_state_update_cpu
    spec_call = spec_aware_ssu(CPUSSUBackend.__call__)
    spec_state, out = state.clone(), torch.empty_like(x)
    spec_call(backend, spec_state, x, dt, A, B, C, D, dt_bias, z, True, indices, indices, NULL, out,
              accepted, starts)
    for b in range(2):
        running = state.clone()
        line = int(indices[b, int(accepted[b]) - 1])
        for i, t in enumerate(range(int(starts[b]), int(starts[b + 1]))):
            one = torch.empty_like(x[t : t + 1])
            index = torch.tensor([line], dtype=torch.int32)
            backend(running, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D, dt_bias,
                    z[t : t + 1], True, index, index, NULL, one)
            torch.testing.assert_close(out[t], one[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(spec_state[int(indices[b, i])], running[line], rtol=1e-5, atol=1e-5)


def test_calls_without_drafts_take_vllms_kernel() -> None:
    calls = []
    wrapped = spec_aware_ssu(lambda *args, **kwargs: calls.append(args))
    wrapped(object(), *([None] * 8))
    assert len(calls) == 1
