"""Store budgets sized from the model's pages (``core/budgets.py``), on the KV cache groups vLLM
forms for Qwen3-Next-80B and Nemotron-H-8B at a GPU engine's block sizes."""

from __future__ import annotations

from typing import Any

import pytest

from hybrid_offload.core.budgets import (
    MIN_BUDGET_BYTES,
    StoreBudgets,
    attention_bytes_per_token,
    state_set_bytes,
    store_budgets,
)
from hybrid_offload.core.spec import GroupKind, GroupSpec
from hybrid_offload.testing.vllm_scheduler import build_scheduler

CONNECTOR = {"backends": [{"type": "cpu", "name": "cpu", "capacity_bytes": 1 << 30}]}
GiB = 1 << 30


def tiny() -> tuple[GroupSpec, ...]:
    attention = GroupSpec(0, GroupKind.FULL_ATTENTION, 16, ("a0", "a1"), page_bytes=16 * 2 * 2 * 64 * 2,
                          num_kv_heads=2, head_size=64, head_size_v=64)  # fmt: skip
    mamba = GroupSpec(1, GroupKind.MAMBA, 16, ("m0",), page_bytes=0, state_shapes=((3, 8), (4, 4)),
                      state_dtypes=("bfloat16", "float32"), mamba_cache_mode="align")  # fmt: skip
    return attention, mamba


def test_bytes_per_token_and_state_set() -> None:
    groups = tiny()
    assert attention_bytes_per_token(groups) == 2 * (2 * 2 * 64 * 2)  # 2 layers, K and V, 2 heads
    assert state_set_bytes(groups) == 3 * 8 * 2 + 4 * 4 * 4
    tiny_model = store_budgets(groups, 8192, 256, 16, cap=64 * GiB)
    assert tiny_model == StoreBudgets(MIN_BUDGET_BYTES, MIN_BUDGET_BYTES)


SHAPES = [("qwen3_next_80b", 1), ("qwen3_next_80b", 4), ("nemotron_h_8b", 2)]


@pytest.mark.parametrize(("model", "tp"), SHAPES)
def test_budgets_for_real_models_hold_two_full_steps_and_every_running_requests_state(
    model: str, tp: int, tmp_path: Any
) -> None:
    connector = build_scheduler(model, tp, CONNECTOR, workdir=tmp_path).connector
    groups = connector.planner.spec.groups
    attention, states = attention_bytes_per_token(groups), state_set_bytes(groups)
    if model == "qwen3_next_80b":  # 12 attention layers of 2 KV heads x 256 (1 at TP 4), bf16
        assert attention == 12 * 2 * min(2, 2 // tp or 1) * 256 * 2
    step = 8192 * attention + 2 * states
    budgets = store_budgets(groups, 8192, 256, connector.planner.chunk_tokens, cap=1 << 50)
    assert budgets.pending >= 2 * step
    if model == "qwen3_next_80b" and tp == 1:  # the fixed 256 MiB dropped most of a step
        assert 2 * step > MIN_BUDGET_BYTES
    assert budgets.held >= 256 * states > MIN_BUDGET_BYTES
    cap = budgets.held // 2
    capped = store_budgets(groups, 8192, 256, connector.planner.chunk_tokens, cap=cap)
    assert capped.held == cap and capped.pending == budgets.pending
