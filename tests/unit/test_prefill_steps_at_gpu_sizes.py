"""Cold prefills at a GPU engine's block sizes take at most one step more with the connector.

vLLM's own scheduler (``hybrid_offload.testing.vllm_scheduler``: real model configs, the block
size a GPU engine picks, ``align`` mode, our ``prefill_stops`` patch) cuts one prompt into
steps with and without our connector. States every ``checkpoint_interval_tokens`` are taken
where vLLM's steps end; only the prompt's tail adds a step.
"""

from __future__ import annotations

from typing import Any

import pytest

from hybrid_offload.core.spec import GroupKind
from hybrid_offload.testing.vllm_scheduler import build_scheduler, prefill_steps

CONNECTOR = {"backends": [{"type": "cpu", "name": "cpu", "capacity_bytes": 1 << 30}]}
LENGTHS = (8192, 20001, 32768, 65536)
#: the block a GPU engine picks (bf16 caches and Qwen3-Next's GDN state; NemotronH's state in float32)
BLOCKS = {("qwen3_next_80b", 1): 544, ("qwen3_next_80b", 2): 544, ("qwen3_next_80b", 4): 272,
          ("nemotron_h_8b", 1): 1040, ("nemotron_h_8b", 2): 1040, ("nemotron_h_8b", 4): 1040}  # fmt: skip


@pytest.mark.parametrize(("model", "tp"), list(BLOCKS))
def test_cold_prefills_take_at_most_one_step_more(model: str, tp: int, tmp_path: Any) -> None:
    plain = build_scheduler(model, tp, workdir=tmp_path)
    ours = build_scheduler(model, tp, CONNECTOR, workdir=tmp_path)
    assert plain.block_size == ours.block_size == BLOCKS[(model, tp)]
    chunk = ours.connector.planner.chunk_tokens
    mamba = {p.index for p in ours.connector.planner.plans if p.kind is GroupKind.MAMBA}
    states: list[int] = []

    def seen(out: Any) -> None:
        meta = out.kv_connector_metadata
        states.extend((s.page.chunk_index + 1) * chunk for s in meta.stores
                      if s.page.group in mamba and not s.hold)  # fmt: skip

    for length in LENGTHS:
        states.clear()
        without = prefill_steps(plain, length, seed=length)
        with_ = prefill_steps(ours, length, seed=length, on_step=seen)
        assert sum(with_) == sum(without) == length
        assert len(with_) <= len(without) + 1, (length, without, with_)
        ends = [sum(with_[: i + 1]) for i in range(len(with_))]
        tail = (length - 1) // chunk * chunk
        # a state where each step ends before the tail (1024-token interval, 7000-token steps)
        # and at the tail, each group's once
        assert sorted(set(states)) == [e for e in ends if e <= tail], (ends, states)
        assert len(states) == len(mamba) * len(set(states))


@pytest.mark.parametrize("model", ["qwen3_next_80b", "nemotron_h_8b"])
def test_gpu_engines_at_any_tp_cut_the_same_chunks_and_share_pages(model: str, tmp_path: Any) -> None:
    """On a GPU the default chunk divides the hybrid block of every TP size (16 tokens), so
    engines at TP 1, 2 and 4 name the same pages; without it Qwen3-Next's TP 1-2 and TP 4
    engines cut 32- and 16-token chunks and share nothing."""
    from hybrid_offload.core.planner import GPU_HYBRID_ALIGNMENT, HybridOffloadPlanner

    tokens = list(range(1000, 1000 + 3000))
    keys, plain = {}, {}
    for tp in (1, 2, 4):
        spec = build_scheduler(model, tp, CONNECTOR, workdir=tmp_path).connector.planner.spec
        planner = HybridOffloadPlanner(spec, hybrid_alignment=GPU_HYBRID_ALIGNMENT)
        assert all(g.block_size % planner.chunk_tokens == 0 for g in spec.groups)
        keys[tp] = planner.group_keys(planner.chunk_hashes(tokens))
        plain[tp] = HybridOffloadPlanner(spec).chunk_tokens
    assert keys[1] == keys[2] == keys[4]
    if model == "qwen3_next_80b":
        assert (plain[1], plain[2], plain[4]) == (32, 32, 16)


@pytest.mark.parametrize("tp", [1, 4])
def test_without_prefix_caching_too(tp: int, tmp_path: Any) -> None:
    """Mamba cache mode ``none`` (prefix caching off): vLLM ends steps on its token budget, not
    on blocks; a step with a state due ends on the chunk boundary before instead, and the
    prefill still takes at most one step more."""
    plain = build_scheduler("qwen3_next_80b", tp, workdir=tmp_path, prefix_caching=False)
    ours = build_scheduler("qwen3_next_80b", tp, CONNECTOR, workdir=tmp_path, prefix_caching=False)
    for length in LENGTHS:
        without = prefill_steps(plain, length, seed=length)
        with_ = prefill_steps(ours, length, seed=length)
        assert sum(with_) == sum(without) == length
        assert len(with_) <= len(without) + 1, (length, without, with_)
