"""Our worker side in the call orders of vLLM's model runners (V1, and V2, the CUDA default):
thousands of random steps of loads, cold prefills with stores, failed loads, preemptions and
blocks reused at once, every loaded block compared byte for byte with what recomputing writes
(``hybrid_offload.testing.runner_replay``). Runs on ``cpu`` in ``make test`` and on ``cuda``
where there is one (``scripts/gpu_check.sh`` runs this folder on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from hybrid_offload.backends import BackendConfig
from hybrid_offload.testing.datapath import HybridShape
from hybrid_offload.testing.runner_replay import ORDERS, replay

DEVICES = [
    "cpu",
    "cpu+gpu-path",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
SMALL = HybridShape(attn_layers=2, kv_heads=4, head_size=64, gdn_layers=4, k_heads=2, v_heads=4,
                    head_k=16, head_v=32, group_layers=2)  # fmt: skip


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("device", DEVICES)
def test_no_mismatch_in_either_runner_order(device: str, order: str) -> None:
    tier = BackendConfig(type="cpu", name="cpu", capacity_bytes=64 << 20)
    result = replay(SMALL, device, [tier], order, steps=2000, seed=7)
    assert result.mismatches == []
    assert result.loads > 300 and result.failed_loads > 30  # both outcomes, many times
    assert result.checked_bytes > 100 << 20


def test_the_replay_sees_a_load_reported_before_it_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a worker that reports every third load before writing it."""
    from hybrid_offload.connector.worker import load_pipeline

    real, calls = load_pipeline.write_pages, [0]

    def lazy(plan, layouts):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] % 3:
            real(plan, layouts)

    monkeypatch.setattr(load_pipeline, "write_pages", lazy)
    tier = BackendConfig(type="cpu", name="cpu", capacity_bytes=64 << 20)
    result = replay(SMALL, "cpu", [tier], "v2", steps=300, seed=7)
    assert any(m.startswith("loaded") for m in result.mismatches)
